//go:build tools

// Package tools pins the Kubernetes binaries the integration tests run
// (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, and the real node's kubelet
// and kube-proxy), built from published Go modules because there is no Docker engine for kind on
// the test machines.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
