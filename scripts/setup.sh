#!/usr/bin/env bash
# Set up .venv/ at the repository root: CPU PyTorch first (a bare `torch` requirement would pull a
# multi-GB CUDA build), then every pdmesh distribution (editable, in one pip call so the local ones
# satisfy each other) with the test tools. Every install is held to the lock, constraints.txt (exact
# versions; refresh with `bash scripts/lock.sh`), so a run here, one on a fresh machine and the images
# resolve the same versions; a .venv that has drifted is moved back to them. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
LOCK=constraints.txt
[ -f "$LOCK" ] || { echo "setup: $LOCK is missing (bash scripts/lock.sh writes it)" >&2; exit 1; }
# The lock's torch unless PDMESH_TORCH_VERSION says otherwise (which must agree with the lock:
# move both with `PDMESH_TORCH_VERSION=X bash scripts/lock.sh`).
TORCH_VERSION=${PDMESH_TORCH_VERSION:-$(sed -n 's/^torch==//p' "$LOCK")}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
# pip's own exit status is kept; only its "location is ignored" chatter about local indexes is dropped.
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored" >&2); }

if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION" >&2
  pip install -c "$LOCK" "torch==$TORCH_VERSION"
fi
echo "setup: installing the pdmesh distributions (editable) and test tools" >&2
editable=()
for dir in $(bash scripts/distributions.sh); do editable+=(-e "./$dir"); done
# compat mode: each editable install is a plain path in a .pth file, which mypy and IDEs can follow.
pip install -c "$LOCK" --config-settings editable_mode=compat "${editable[@]}" -e ".[test]"
.venv/bin/python -c "import torch, pdmesh_engine, pdmesh_gateway, pdmesh.cli.main" \
  || { echo "setup: the install is broken" >&2; exit 1; }
# The CPU layer kernel (C, OpenMP) is compiled once per machine into ~/.cache/pdmesh/kernels; do it
# now rather than in the first request. Without a C compiler the engine keeps its torch path.
.venv/bin/python -c "import torch; from pdmesh_kernels import cpu_layers as c; c.library(); c.library(torch.bfloat16)" \
  || echo "setup: the CPU layer kernel did not build (the engine uses its torch path)" >&2
echo "setup: ready (.venv/bin/pdmesh)" >&2
