#!/usr/bin/env bash
# Set everything up, then run the whole test suite (what CI runs): pytest, then the torch-free
# images built and their control plane served from them (scripts/test-images.sh --light; it needs
# root, to install and start Docker, or a Docker daemon this user can reach). Arguments go to pytest,
# and then only pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
[ $# -gt 0 ] && exit 0
if [ "$(id -u)" = 0 ] || docker info >/dev/null 2>&1; then
    bash scripts/test-images.sh --light
else
    echo "test.sh: the image test needs root or a reachable Docker daemon: not run" >&2
    exit 1
fi
