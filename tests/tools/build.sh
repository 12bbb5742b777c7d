#!/usr/bin/env bash
# Builds the real test binaries from the pinned Go modules beside this script, once per version, into
# ~/.cache/sneppx/bin/<tool>-<version>: the control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler, etcd), kubectl, helm and versitygw (the S3 server); and the real node of tests/node
# (kubelet, kube-proxy, containerd with its shim and ctr, runc, and the CNI plugins in bin/cni-<version>/).
# Prints the bin directory on stdout.
# Idempotent: a cached binary is never rebuilt. Safe side by side (two checkouts' `make test`, or a test that
# builds while another does): each binary is built under its own lock (<binary>.lock, flock), into a temporary
# name of its own, and moved into place whole, so a second build waits for the first and then finds the binary.
# Usage: build.sh [TOOL...]   (no TOOL: all of them; e.g. `build.sh versitygw`)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${SNEPPX_CACHE:-$HOME/.cache/sneppx}/bin"
mkdir -p "$cache"
export GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0
wanted=" ${*:-kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl etcd helm versitygw containerd runc cni} "

version_of() {  # version of a required module in a tools go.mod
  awk -v m="$2" '$1==m || ($1=="require" && $2==m) {print ($1=="require") ? $3 : $2; exit}' "$here/$1/go.mod"
}

build() {  # build <tools dir> <package> <binary> <version> [ldflags] [tags]
  local dir=$1 pkg=$2 bin=$3 ver=$4 ldflags=${5:-} tags=${6:-}
  local out="$cache/$bin-$ver"
  [[ $wanted == *" $bin "* || $wanted == *" $dir "* ]] || return 0
  mkdir -p "$(dirname "$out")"
  local lock tmp
  exec {lock}>"$out.lock"
  flock "$lock"  # released when the descriptor closes below, or when this script ends (a build that failed)
  if [ ! -x "$out" ]; then
    echo "building $bin $ver (cold build, several minutes)..." >&2
    # A directory of its own: `go build -o` refuses to replace a non-empty file that is not a binary
    tmp=$(mktemp -d "$out.tmp.XXXXXX")
    (cd "$here/$dir" && go build -trimpath -tags "$tags" -ldflags "-s -w $ldflags" -o "$tmp/$(basename "$bin")" "$pkg") >&2 \
      || { rm -rf "$tmp"; return 1; }
    mv "$tmp/$(basename "$bin")" "$out"
    rmdir "$tmp"
  fi
  ln -sf "$out" "$cache/$bin"
  exec {lock}>&-
}

kube=$(version_of kube k8s.io/kubernetes)
kv="-X k8s.io/component-base/version.gitVersion=$kube -X k8s.io/component-base/version.gitMajor=$(echo "$kube" | cut -d. -f1 | tr -d v) -X k8s.io/component-base/version.gitMinor=$(echo "$kube" | cut -d. -f2)"
build kube k8s.io/kubernetes/cmd/kube-apiserver kube-apiserver "$kube" "$kv"
build kube k8s.io/kubernetes/cmd/kube-controller-manager kube-controller-manager "$kube" "$kv"
build kube k8s.io/kubernetes/cmd/kube-scheduler kube-scheduler "$kube" "$kv"
build kube k8s.io/kubernetes/cmd/kubelet kubelet "$kube" "$kv"
build kube k8s.io/kubernetes/cmd/kube-proxy kube-proxy "$kube" "$kv"
build kube k8s.io/kubernetes/cmd/kubectl kubectl "$kube" "$kv"
build etcd go.etcd.io/etcd/server/v3 etcd "$(version_of etcd go.etcd.io/etcd/server/v3)"
helm_v=$(version_of helm helm.sh/helm/v3)
# Stamped like helm's Makefile does: the exact version (the source says only "v3.20"), and the
# Kubernetes version `helm template`/`lint` assume, from client-go v0.X.Y -> 1.X (the default is 1.20).
client_go=$(version_of helm k8s.io/client-go)
k8s_minor=$(echo "$client_go" | cut -d. -f2)
helm_flags="-X helm.sh/helm/v3/internal/version.version=$helm_v"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  helm_flags="$helm_flags -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done
build helm helm.sh/helm/v3/cmd/helm helm "$helm_v" "$helm_flags"
vgw=$(version_of versitygw github.com/versity/versitygw)
build versitygw github.com/versity/versitygw/cmd/versitygw versitygw "$vgw" "-X main.Version=$vgw"
ctd=$(version_of containerd github.com/containerd/containerd/v2)
ctd_flags="-X github.com/containerd/containerd/v2/version.Version=$ctd"
ctd_tags="no_btrfs no_devmapper no_zfs"
for bin in containerd containerd-shim-runc-v2 ctr; do
  build containerd "github.com/containerd/containerd/v2/cmd/$bin" "$bin" "$ctd" "$ctd_flags" "$ctd_tags"
done
# runc needs cgo (its nsenter) and libseccomp: the restricted pod profile asks for the RuntimeDefault filter
runc_v=$(version_of runc github.com/opencontainers/runc)
if [[ $wanted == *" runc "* && ! -x "$cache/runc-$runc_v" ]] && ! pkg-config --exists libseccomp 2>/dev/null; then
  echo "installing libseccomp-dev for runc..." >&2
  apt-get install -y -q libseccomp-dev >&2
fi
CGO_ENABLED=1 build runc github.com/opencontainers/runc runc "$runc_v" "-X main.version=${runc_v#v}" seccomp
cni_v=$(version_of cni github.com/containernetworking/plugins)
for plugin in ipam/host-local main/bridge main/loopback meta/portmap; do
  build cni "github.com/containernetworking/plugins/plugins/$plugin" "cni-$cni_v/${plugin#*/}" "$cni_v"
done
echo "$cache"
