#!/usr/bin/env bash
# Registry-free base images for scripts/test-images.sh, made only where the configured ones cannot be
# pulled:
#   bash scripts/images/base.sh python TAG   # Debian bookworm + python3.11, venv, CA certificates
#   bash scripts/images/base.sh redis TAG BASE_TAG   # the python base + redis-server and redis-cli
# The python base comes from `debootstrap` (installed from Debian's packages when missing) against
# $DEBIAN_MIRROR, imported with `docker import`; the Redis one is built on it with apt.
set -euo pipefail
kind=$1 tag=$2
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

case $kind in
python)
    command -v debootstrap >/dev/null || {
        echo "base: installing debootstrap" >&2
        export DEBIAN_FRONTEND=noninteractive
        { apt-get install -y -q debootstrap || { apt-get update -q && apt-get install -y -q debootstrap; }; } >/dev/null
    }
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
    echo "base: debootstrap bookworm (python3, venv, ca-certificates) from $mirror" >&2
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
    rm -f "$root.log"
    # what an image needs no copy of: package caches and lists, documentation, translations
    rm -rf "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
        "$root"/usr/share/man/* "$root"/usr/share/locale/*
    tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' - "$tag" >/dev/null
    ;;
redis)
    base=$3
    printf '%s\n' "FROM $base" \
        'RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \' \
        '    && rm -rf /var/lib/apt/lists/*' \
        'CMD ["redis-server"]' | docker build -q -t "$tag" - >/dev/null
    ;;
*)
    echo "usage: base.sh python TAG | redis TAG BASE_TAG" >&2
    exit 2
    ;;
esac
echo "base: built $tag ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}'))" >&2
