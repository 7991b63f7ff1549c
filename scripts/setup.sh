#!/usr/bin/env bash
# Set up .venv/ at the repository root: CPU PyTorch first (a bare `torch` requirement would pull a
# multi-GB CUDA build), then pdmesh itself (editable) with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${PDMESH_TORCH_VERSION:-2.13.0}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
# pip's own exit status is kept; only its "location is ignored" chatter about local indexes is dropped.
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored" >&2); }

if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION" >&2
  pip install "torch==$TORCH_VERSION"
fi
echo "setup: installing pdmesh and its client SDK (editable) and test tools" >&2
pip install -e ./sdk -e ".[test]"
.venv/bin/python -c "import torch, pdmesh.engine" || { echo "setup: the install is broken" >&2; exit 1; }
echo "setup: ready (.venv/bin/pdmesh)" >&2
