#!/usr/bin/env bash
# Regenerate constraints.txt, the lock that scripts/setup.sh and every image install with `-c`:
#
#   bash scripts/lock.sh                                  # newest versions the indexes offer
#   PDMESH_TORCH_VERSION=2.14.0 bash scripts/lock.sh      # move torch too (default: the lock's torch)
#
# A fresh temporary venv (never .venv) gets torch first, as setup.sh does, then every pdmesh
# distribution (non-editable, from a copy of the work tree, so nothing is written into it) with its
# extras, the test tools and the optional packages below. Its `pip list` is the lock, less the pdmesh
# distributions and pip/setuptools/wheel, names normalised and sorted; torch is written without its
# local label (`torch==2.13.0` is met by 2.13.0+cpu and by a CUDA build of the same release alike).
#
# The GPU images install the default (CUDA) Linux build of the same torch, which needs packages the
# CPU build does not (triton at one exact version, nvidia-* and cuda-* wheels). That build's
# requirements are resolved from the configured indexes first (a dry run: metadata only, nothing is
# downloaded where the index serves it) and its exact pins (triton) bind the CPU install too; then a
# second dry run under the finished lock adds its GPU-only packages, so one lock serves both kinds.
# The whole run takes a few minutes and needs the package indexes.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
LOCK=constraints.txt
default_torch=$(sed -n 's/^torch==//p' "$LOCK" 2>/dev/null || true)
TORCH_VERSION=${PDMESH_TORCH_VERSION:-${default_torch:-2.13.0}}
# Installed by no requirement here, pinned so that where they are installed they take the lock's
# version: xgrammar, used by the code when present (`pdmesh bench grammar` measures it beside
# llguidance); async-timeout, which redis requires on Python < 3.11.3 (Debian bookworm's 3.11.2:
# the registry-free image base of scripts/images/base.sh).
OPTIONAL=(xgrammar async-timeout)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
started=$(date +%s)

# pip's own exit status is kept; only its "location is ignored" chatter about local indexes is dropped.
pip() { "$tmp/venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored" >&2); }
# The lock's body from `pip list --format=freeze` on stdin: normalised names, no pdmesh-*,
# pip/setuptools/wheel or torch local label, sorted.
normalise() {
  "$tmp/venv/bin/python" -c '
import re, sys
pins = {}
for line in sys.stdin:
    if not line.strip():
        continue
    name, sep, version = line.strip().partition("==")
    name = re.sub(r"[-_.]+", "-", name.split(" @ ")[0].strip()).lower()
    if name in ("pip", "setuptools", "wheel") or name == "pdmesh" or name.startswith("pdmesh-"):
        continue
    if not sep:
        sys.exit(f"lock: not a name==version line: {line.strip()}")
    if name == "torch":
        version = version.split("+")[0]
    pins[name] = version
sys.stdout.writelines(f"{n}=={pins[n]}\n" for n in sorted(pins))
'
}
# `pip install --dry-run --report` → the `name==version` lines of what it would install.
report_pins() {
  "$tmp/venv/bin/python" -c '
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    print(meta["name"] + "==" + meta["version"])
' "$1"
}

echo "lock: fresh venv in $tmp (torch==$TORCH_VERSION)" >&2
"$PYTHON" -m venv "$tmp/venv"

# The CUDA build: `===` is an exact string match, so no `+cpu` (or other local) build stands in.
echo "lock: resolving the CUDA build's requirements (dry run)" >&2
pip install --dry-run --ignore-installed --only-binary=:all: --report "$tmp/gpu.json" "torch===$TORCH_VERSION"
"$tmp/venv/bin/python" -c '
import json, re, sys
for item in json.load(open(sys.argv[1]))["install"]:
    if item["metadata"]["name"].lower() != "torch":
        continue
    for req in item["metadata"].get("requires_dist", []):
        # Exact pins only (triton==X.Y.Z): lower bounds are left to the resolve below.
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;,]+)\s*(;.*)?$", req)
        if match and "extra" not in (match.group(3) or ""):
            print(f"{match.group(1)}=={match.group(2)}")
' "$tmp/gpu.json" >"$tmp/gpu-exact.txt"
echo "lock: the CUDA build pins $(tr '\n' ' ' <"$tmp/gpu-exact.txt")" >&2

# A copy of the work tree (tracked and untracked files, not ignored ones): the builds write there.
mkdir "$tmp/src"
git ls-files -z --cached --others --exclude-standard \
  | "$tmp/venv/bin/python" -c '
import os, shutil, sys
for path in sys.stdin.read().split("\0"):
    if path and os.path.isfile(path):  # a deleted tracked file is listed too
        os.makedirs(os.path.join(sys.argv[1], os.path.dirname(path)), exist_ok=True)
        shutil.copy2(path, os.path.join(sys.argv[1], path))
' "$tmp/src"

echo "lock: installing torch==$TORCH_VERSION" >&2
pip install -c "$tmp/gpu-exact.txt" "torch==$TORCH_VERSION"
echo "lock: installing every pdmesh distribution, the test tools and ${OPTIONAL[*]}" >&2
dists=()
for dir in $(bash scripts/distributions.sh); do dists+=("$tmp/src/$dir"); done
pip install -c "$tmp/gpu-exact.txt" "${dists[@]}" "$tmp/src[test]" "${OPTIONAL[@]}"
pip check
# Not through pip() above: `pip list -q` prints nothing (its output is logged at info level).
"$tmp/venv/bin/python" -m pip --disable-pip-version-check list --format=freeze | normalise >"$tmp/cpu.txt"

echo "lock: adding the CUDA build's own packages (dry run under the lock)" >&2
pip install --dry-run --ignore-installed --only-binary=:all: -c "$tmp/cpu.txt" \
  --report "$tmp/gpu-locked.json" "torch===$TORCH_VERSION"
report_pins "$tmp/gpu-locked.json" | cat - "$tmp/cpu.txt" | normalise >"$tmp/all.txt"

python_tag=$("$tmp/venv/bin/python" -c 'import platform, sys; print(f"CPython {sys.version_info[0]}.{sys.version_info[1]}, {platform.system()} {platform.machine()}")')
{
  echo "# The lock: exact versions of every third-party distribution pdmesh installs, for"
  echo "# scripts/setup.sh and every image (\`pip install -c constraints.txt ...\`)."
  echo "# Generated by scripts/lock.sh; do not edit by hand. Refresh with: bash scripts/lock.sh"
  echo "# Resolved for $python_tag; torch is pinned without its local label (+cpu or a"
  echo "# CUDA build of the release both match), and the CUDA build's own packages are included."
  cat "$tmp/all.txt"
} >"$tmp/$LOCK"
mv "$tmp/$LOCK" "$LOCK"
echo "lock: wrote $LOCK ($(grep -vc '^#' "$LOCK") pins) in $(($(date +%s) - started)) s" >&2
