#!/bin/sh
# Builds a minimal Debian root filesystem with Python from the OS package mirror and writes it
# to stdout as a tar stream, ready for `docker import` (or the Docker API's image create with
# fromSrc=-). This is the offline fallback of docs/design.md D7: it needs no container registry,
# only debootstrap, root, and a reachable Debian mirror.
#
# usage: debootstrap-base.sh RELEASE [MIRROR] > rootfs.tar
#   RELEASE  a Debian suite: bookworm (Python 3.11), trixie (Python 3.13), ...
#   MIRROR   default: $PYBERTH_DEBIAN_MIRROR or http://deb.debian.org/debian
set -eu

release=${1:?usage: debootstrap-base.sh RELEASE [MIRROR]}
mirror=${2:-${PYBERTH_DEBIAN_MIRROR:-http://deb.debian.org/debian}}

if ! command -v debootstrap >/dev/null 2>&1; then
    echo "debootstrap-base: debootstrap is not installed (apt-get install debootstrap)" >&2
    exit 3
fi
if [ "$(id -u)" != 0 ]; then
    echo "debootstrap-base: debootstrap needs root" >&2
    exit 3
fi

root=$(mktemp -d "${TMPDIR:-/tmp}/pyberth-rootfs.XXXXXX")
trap 'rm -rf "$root"' EXIT INT TERM

# minbase keeps the image small; python3-pip and ca-certificates serve the dependency installer.
debootstrap --variant=minbase \
    --include=python3,python3-pip,python3-venv,ca-certificates \
    "$release" "$root" "$mirror" >&2

# Drop what a sandbox never needs: package caches, docs, man pages.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
       "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
# A sandbox base has no live devices or mounts of its own; Docker supplies /dev, /proc, /sys.
rm -rf "$root"/dev/* "$root"/proc/* "$root"/sys/*

tar --numeric-owner -C "$root" -cf - .
