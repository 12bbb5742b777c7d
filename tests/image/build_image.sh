#!/usr/bin/env bash
# Builds the project's image from ./Dockerfile, unchanged, where there is no Docker and no registry:
# buildah (vfs storage, chroot isolation) FROM a stand-in for python:3.11-slim-bookworm made from Debian
# packages with debootstrap, passed in through the Dockerfile's PYTHON_IMAGE build argument.
#
#   tests/image/build_image.sh [TAG]     # default localhost/sneppx:dev; TAG on stdout, progress on stderr
#
# The base is built once per set of inputs (this recipe, the suite, the packages, the host's extra CAs and
# pip.conf) and cached as an OCI archive under ${SNEPPX_CACHE:-~/.cache/sneppx}/image-base/. The image itself
# is built every time. Storage is buildah's own (CONTAINERS_STORAGE_CONF selects it; the tests use a
# throwaway one). Needs root (debootstrap, buildah's chroot isolation); installs buildah and debootstrap
# with apt-get when they are missing. Exits 77, the reason on stderr, where they can't be had.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
tag=${1:-localhost/sneppx:dev}
cache="${SNEPPX_CACHE:-$HOME/.cache/sneppx}/image-base"
export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot} STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}

SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# python:3.11-slim-bookworm has Python's headers (the build stage compiles against them), pip and venv.
PACKAGES=python3,python3-dev,python3-pip,python3-venv,passwd,ca-certificates

skip() { echo "$*" >&2; exit 77; }
log() { echo "build_image: $*" >&2; }

install_tools() {
  local missing=()
  command -v buildah >/dev/null || missing+=(buildah)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [ "$(id -u)" = 0 ] \
    || skip "the image build needs root (debootstrap, buildah's chroot isolation); running as uid $(id -u)"
  [ ${#missing[@]} = 0 ] && return
  command -v apt-get >/dev/null || skip "${missing[*]} not installed and no apt-get to install them"
  log "installing ${missing[*]} with apt-get"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2 \
    || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2; }
}

# Everything that shapes the base is in this function and the variables above; its text is the cache key.
build_base() {  # build_base NAME: commit a python:3.11-slim-bookworm stand-in as image NAME
  local ctr root
  ctr=$(buildah from scratch)
  root=$(buildah mount "$ctr")
  nice debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" >&2
  # As debian:bookworm-slim: no docs, man pages or translations, now or from any later apt-get install.
  { printf 'path-exclude /usr/share/%s/*\n' doc man info locale groff lintian linda
    printf 'path-include /usr/share/doc/*/copyright\n'; } >"$root/etc/dpkg/dpkg.cfg.d/docker"
  find "$root/usr/share/doc" -type f ! -name copyright -delete
  rm -rf "$root"/usr/share/{man,info,locale,groff,lintian,linda}/* "$root"/var/lib/apt/lists/* \
    "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb "$root"/var/log/*.log
  # As python:3.11-slim: `python` and `pip` on PATH, and pip may install into the interpreter's site-packages.
  ln -s /usr/bin/python3 "$root/usr/local/bin/python"
  ln -s /usr/bin/pip3 "$root/usr/local/bin/pip"
  rm -f "$root"/usr/lib/python3.*/EXTERNALLY-MANAGED
  # Builds from this base reach the same index the host does: its extra CAs (a TLS-inspecting egress proxy
  # adds one) and its pip.conf. Both are part of the cache key.
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
  [ ! -f /etc/pip.conf ] || cp /etc/pip.conf "$root/etc/pip.conf"
  chroot "$root" update-ca-certificates >&2
  buildah umount "$ctr" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd python3 "$ctr"
  buildah commit -q --rm "$ctr" "$1" >/dev/null
}

base_key() {
  { declare -f build_base; echo "$SUITE $PACKAGES"
    cat /usr/local/share/ca-certificates/*.crt /etc/pip.conf 2>/dev/null || true; } | sha256sum | cut -c1-16
}

# Puts the base into buildah's storage (building it, or loading the cached archive) and prints its name.
load_base() {
  local key base archive started=$SECONDS
  key=$(base_key)
  base=localhost/sneppx-base:$key
  archive=$cache/$key.oci.tar
  if buildah inspect --type image "$base" >/dev/null 2>&1; then
    log "base $base already in storage"
  elif [ -f "$archive" ]; then
    buildah tag "$(buildah pull -q "oci-archive:$archive")" "$base"
    log "base loaded from $archive in $((SECONDS - started)) s"
  else
    log "building base $base with debootstrap (a few minutes)"
    build_base "$base"
    mkdir -p "$cache"
    buildah push -q "$base" "oci-archive:$archive.$$.tmp"
    mv "$archive.$$.tmp" "$archive"  # atomic, so a concurrent build never reads half an archive
    log "base built and cached as $archive in $((SECONDS - started)) s"
  fi
  echo "$base"
}

install_tools
base=$(load_base)
started=$SECONDS
log "building $tag from $repo/Dockerfile (PYTHON_IMAGE=$base)"
nice buildah bud --pull=never --build-arg "PYTHON_IMAGE=$base" -t "$tag" "$repo" >&2
log "image $tag built in $((SECONDS - started)) s"
echo "$tag"
