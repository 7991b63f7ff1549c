#!/bin/sh
# The builder stage's setup, shared by every pdmesh image (COPY deploy/image/ /opt/build/ first):
#   sh /opt/build/builder.sh [--compiler]
# - Python: a base image without python3 and venv (a CUDA or plain Debian/Ubuntu base) gets them
#   from its distribution's packages;
# - --compiler: a C compiler, for the CPU layer kernel that worker images compile at build time
#   (the shipped stage needs none: it loads the prebuilt library);
# - EXTRA_CA_CERTS (a build argument: PEM text): certificate authorities this stage trusts besides
#   the base's, for a proxy that intercepts TLS; apt and pip use them. The shipped stage never sees
#   them;
# - the virtualenv every image ships, /opt/venv.
set -eu
packages=""
python3 -c "import venv, ensurepip" 2>/dev/null || packages="python3 python3-venv"
if [ "${1:-}" = "--compiler" ] && ! command -v cc >/dev/null 2>&1; then
    packages="$packages gcc libc6-dev"
fi
if [ -n "${EXTRA_CA_CERTS:-}" ]; then
    bundle=/etc/ssl/certs/ca-certificates.crt
    if command -v update-ca-certificates >/dev/null 2>&1; then
        printf '%s\n' "$EXTRA_CA_CERTS" > /usr/local/share/ca-certificates/pdmesh-build-extra.crt
        update-ca-certificates >/dev/null
    else
        mkdir -p "$(dirname "$bundle")"
        printf '%s\n' "$EXTRA_CA_CERTS" >> "$bundle"
    fi
    # pip trusts its own bundle (certifi) unless told otherwise
    printf '[global]\ncert = %s\n' "$bundle" > /etc/pip.conf
fi
if [ -n "$packages" ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    # shellcheck disable=SC2086  # a list of package names
    apt-get install -y --no-install-recommends $packages
    rm -rf /var/lib/apt/lists/*
fi
python3 -m venv /opt/venv
