//go:build tools

// Package tools pins containerd, the container runtime the real node's kubelet talks to over CRI:
// the daemon, its runc shim, and ctr (to import the images, since nothing is pulled from a registry).
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
