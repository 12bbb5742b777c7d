//go:build tools

// Package tools pins etcd for the test apiserver; etcd's own go.mod has
// replace directives, so it is built from this wrapper module.
package tools

import _ "go.etcd.io/etcd/server/v3"
