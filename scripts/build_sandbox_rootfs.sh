#!/usr/bin/env bash
# Builds a cached, versioned Debian root filesystem for the sandbox (the `rootfs` image kind):
#   scripts/build_sandbox_rootfs.sh [DEST_PARENT] [PACKAGES...]
# The directory name carries the suite and a hash of the package list, so a changed list builds a new
# version and an unchanged one is reused (a tarball next to it makes re-extraction take ~1 s).
# Use it with: tide-sandbox serve --rootfs debian=<printed directory> [--default-image debian]
set -euo pipefail
PARENT=${1:-/var/lib/tide-sandbox/rootfs}
shift || true
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PACKAGES=("$@")
((${#PACKAGES[@]})) || PACKAGES=(python3 bash coreutils gcc g++ libc6-dev nodejs default-jdk-headless)
VERSION=$(printf '%s\n' "$SUITE" "${PACKAGES[@]}" | sha256sum | cut -c1-12)
DEST=$PARENT/$SUITE-$VERSION
TARBALL=$DEST.tar

if [ -f "$DEST/.tide-rootfs" ]; then echo "$DEST"; exit 0; fi
if [ "$(id -u)" != 0 ]; then echo "needs root" >&2; exit 1; fi
mkdir -p "$PARENT"
TMP=$(mktemp -d "$PARENT/.build-XXXXXX")
trap 'rm -rf "$TMP"' EXIT
if [ -f "$TARBALL" ]; then
  tar -C "$TMP" -xf "$TARBALL"
else
  INCLUDE=$(IFS=,; echo "${PACKAGES[*]}")
  if command -v mmdebstrap >/dev/null; then
    mmdebstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$TMP" "$MIRROR" >&2
  elif command -v debootstrap >/dev/null; then
    debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$TMP" "$MIRROR" >&2
  else
    echo "install mmdebstrap or debootstrap (apt-get install debootstrap)" >&2; exit 1
  fi
  # What the sandbox expects: a work directory owned by the sandbox user, world-writable /tmp, no caches.
  rm -rf "$TMP"/var/cache/apt/archives/*.deb "$TMP"/var/lib/apt/lists/*
  tar -C "$TMP" -cf "$TARBALL.partial" . && mv "$TARBALL.partial" "$TARBALL"
fi
mkdir -p "$TMP/work" "$TMP/proc" "$TMP/dev"
chown 65534:65534 "$TMP/work"
chmod 1777 "$TMP/tmp"
printf '%s\n' "suite=$SUITE" "packages=${PACKAGES[*]}" "version=$VERSION" > "$TMP/.tide-rootfs"
mv "$TMP" "$DEST"
trap - EXIT
echo "$DEST"
