//go:build tools

// Package tools pins runc, the OCI runtime containerd's shim runs containers with (Debian's runc and
// crun are too old for the OCI spec version containerd 2.4 writes).
package tools

import _ "github.com/opencontainers/runc"
