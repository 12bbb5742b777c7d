#!/usr/bin/env bash
# Builds the real Kubernetes test binaries (kube-apiserver, kubectl, etcd, helm)
# from the pinned Go modules beside this script, once per version, into
# ~/.cache/sneppx/bin/<tool>-<version>. Prints the bin directory on stdout.
# Idempotent: a cached binary is never rebuilt.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${SNEPPX_CACHE:-$HOME/.cache/sneppx}/bin"
mkdir -p "$cache"
export GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0

version_of() {  # version of a required module in a tools go.mod
  awk -v m="$2" '$1==m || ($1=="require" && $2==m) {print ($1=="require") ? $3 : $2; exit}' "$here/$1/go.mod"
}

build() {  # build <tools dir> <package> <binary> <version> [ldflags]
  local dir=$1 pkg=$2 bin=$3 ver=$4 ldflags=${5:-}
  local out="$cache/$bin-$ver"
  if [ ! -x "$out" ]; then
    echo "building $bin $ver (cold build, several minutes)..." >&2
    (cd "$here/$dir" && go build -trimpath -ldflags "-s -w $ldflags" -o "$out.tmp" "$pkg") >&2
    mv "$out.tmp" "$out"
  fi
  ln -sf "$out" "$cache/$bin"
}

kube=$(version_of kube k8s.io/kubernetes)
kv="-X k8s.io/component-base/version.gitVersion=$kube -X k8s.io/component-base/version.gitMajor=$(echo "$kube" | cut -d. -f1 | tr -d v) -X k8s.io/component-base/version.gitMinor=$(echo "$kube" | cut -d. -f2)"
build kube k8s.io/kubernetes/cmd/kube-apiserver kube-apiserver "$kube" "$kv"
build kube k8s.io/kubernetes/cmd/kubectl kubectl "$kube" "$kv"
build etcd go.etcd.io/etcd/server/v3 etcd "$(version_of etcd go.etcd.io/etcd/server/v3)"
helm_v=$(version_of helm helm.sh/helm/v3)
# helm's source says only "v3.20"; stamp the exact version so `helm version` is precise.
build helm helm.sh/helm/v3/cmd/helm helm "$helm_v" "-X helm.sh/helm/v3/internal/version.version=$helm_v"
echo "$cache"
