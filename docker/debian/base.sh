#!/usr/bin/env bash
# Builds a Debian bookworm base image from the host's apt mirror, for hosts that reach no image
# registry (docker/smoke.sh calls it when the image is missing):
#   docker/debian/base.sh [IMAGE]        as root; default conveyor-base:bookworm
# The image carries python3 (with venv and pip), g++ for the CPU kernels, and the CAs the host
# added to Debian's, so pip and apt inside trust what the host trusts (a TLS-inspecting egress
# proxy too). MIRROR overrides the apt mirror found in /etc/apt/sources.list*.
set -euo pipefail

image=${1:-conveyor-base:bookworm}
packages=python3,python3-venv,python3-pip,g++,ca-certificates

# The first deb.debian.org-style URI apt uses here; a snapshot or local mirror works the same.
mirror=$(grep -hoE '^(URIs:|deb) +[^ ]+' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | awk '{print $2}' | grep -E '/debian/?$' | head -n 1 || true)
mirror=${MIRROR:-${mirror:-http://deb.debian.org/debian}}

rootfs=$(mktemp -d /tmp/conveyor-rootfs.XXXXXX)
# --one-file-system: a debootstrap cut short can leave /proc or /sys mounted inside.
trap 'rm -rf --one-file-system "$rootfs"' EXIT

debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" >&2
# Extra CAs the host was given (Debian keeps them in /usr/local/share/ca-certificates).
if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >&2
fi
# Lists and caches stay out of the image; the Dockerfile runs apt-get update when it needs one.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" -c . | podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$image" >&2
