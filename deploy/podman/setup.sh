#!/usr/bin/env bash
# Makes a Debian host ready to build and run Tandem's image with podman, as the tests
# do (no Docker engine, no registry): podman with runc, and a bookworm base image
# debootstrapped from the Debian mirror apt already uses. Idempotent; needs root.
#
#   deploy/podman/setup.sh            # then: podman build ... (see docs/deploy.md)
set -euo pipefail

BASE_IMAGE=localhost/bookworm-base

if ! command -v podman >/dev/null || ! command -v runc >/dev/null \
        || ! command -v debootstrap >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc debootstrap
fi

# crun (podman's default) refuses hybrid cgroup hosts; high nofile limits cannot be set.
conf=/etc/containers/containers.conf
if ! grep -qs 'runtime *= *"runc"' "$conf"; then
    mkdir -p /etc/containers
    cat >> "$conf" <<'CONF'
[engine]
runtime = "runc"

[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
CONF
fi

if ! podman image exists "$BASE_IMAGE"; then
    # Debian's own mirror (not a dated snapshot: the image's apt must still trust it
    # when it installs Python and g++ during the build).
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
    tar -C "$root" -c . | podman import - "$BASE_IMAGE"
fi
echo "podman ready: $(podman --version), base image $BASE_IMAGE"
