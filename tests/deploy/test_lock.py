"""The lock, constraints.txt (written by scripts/lock.sh): well-formed, covering every requirement
the pyproject files declare, matched exactly by the running venv (scripts/setup.sh installs with
`-c constraints.txt`), and passed by every Dockerfile's `pip install`. scripts/lockcheck.py, which
the image test runs on each image's `pip freeze`, is tested here on good and bad input.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK_PATH = ROOT / "constraints.txt"
DOCKERFILES = sorted(ROOT.glob("services/*/Dockerfile")) + [ROOT / "deploy" / "cli.Dockerfile"]
# Each image installs some of these; the CPU image installs nixl-cu12 alone and nixl with --no-deps.
MUST_PIN = ("torch", "triton", "nixl", "nixl-cu12", "nixl-cu13")


def _load(name: str) -> ModuleType:
    """A module of scripts/ (not a package), loaded from its file once."""
    key = f"pdmesh_{name}_script"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "scripts" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # dataclasses resolve their module through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[key]


lockcheck = _load("lockcheck")
closure = _load("closure")


def _lock() -> dict[str, str]:
    pins: dict[str, str] = lockcheck.parse_lock(LOCK_PATH.read_text())
    return pins


# ---- (b) the file itself ------------------------------------------------------------------------


def test_lock_is_well_formed() -> None:
    lines = LOCK_PATH.read_text().splitlines()
    header = [line for line in lines if line.startswith("#")]
    body = [line for line in lines if not line.startswith("#")]
    assert header and lines[: len(header)] == header, "comments only in the header, at the top"
    assert any("bash scripts/lock.sh" in line for line in header), "the header says how to refresh"
    assert body, "no pins"
    names = []
    for line in body:
        match = re.fullmatch(r"([a-z0-9]+(?:-[a-z0-9]+)*)==([A-Za-z0-9.+!]+)", line)
        assert match, f"not one normalised name==version: {line!r}"
        Version(match.group(2))  # a valid PEP 440 version
        names.append(match.group(1))
    assert names == sorted(names), "pins are sorted by name"
    assert len(names) == len(set(names)), "a name is pinned twice"
    assert not [n for n in names if lockcheck.is_exempt(n)], "pdmesh-*, pip, setuptools, wheel"


def test_lock_pins_the_accelerator_stack() -> None:
    lock = _lock()
    assert [name for name in MUST_PIN if name not in lock] == []
    assert "+" not in lock["torch"], "torch without its local label: +cpu and CUDA builds match"
    # The GPU images' CUDA torch pins triton exactly: the lock holds the same (scripts/lock.sh).
    assert any(name.startswith("nvidia-") for name in lock), "the CUDA build's packages"


def test_lock_meets_every_declared_requirement() -> None:
    """Each third-party requirement of each local distribution (extras too) is pinned at a version
    it allows: a requirement added to a pyproject without `bash scripts/lock.sh` fails here."""
    lock = _lock()
    problems = []
    for dist in closure.discover(ROOT).values():
        every = [*dist.requires, *(r for reqs in dist.extras.values() for r in reqs)]
        for req in every:
            if req.name.startswith("pdmesh"):
                continue
            parsed = Requirement(req.text)
            if parsed.marker is not None and not parsed.marker.evaluate({"extra": ""}):
                continue
            if req.name not in lock:
                problems.append(f"{dist.folder}: {req.text} is not in the lock")
            elif not parsed.specifier.contains(lock[req.name], prereleases=True):
                problems.append(f"{dist.folder}: {req.text} excludes the lock's =={lock[req.name]}")
    assert problems == []


# ---- (a) the running venv -----------------------------------------------------------------------


def _installed() -> dict[str, str | None]:
    """This interpreter's distributions, as `import` sees them (the first of a name on sys.path)."""
    found: dict[str, str | None] = {}
    for dist in importlib.metadata.distributions():
        name = lockcheck.normalize(dist.metadata["Name"])
        found.setdefault(name, str(Version(dist.version)))
    return found


def test_venv_matches_the_lock() -> None:
    """Every installed third-party distribution is in the lock at its version (torch compared
    without its local label). Fix: `bash scripts/setup.sh` (it installs with `-c constraints.txt`),
    or uninstall what was installed by hand, or add it to the lock (scripts/lock.sh)."""
    problems = lockcheck.mismatches(_installed(), _lock())
    assert problems == [], "the venv differs from constraints.txt:\n" + "\n".join(problems)


# ---- scripts/lockcheck.py (run by the image test on each image's `pip freeze`) ------------------

LOCK_TEXT = """\
# header
numpy==2.4.6
torch==2.13.0
triton==3.7.1
"""
GOOD_FREEZE = """\
numpy==2.4.6
pdmesh-proto @ file:///src/protos
pdmesh_service==0.1.0
-e git+https://example.invalid/pdmesh.git@abc#egg=pdmesh
pip==24.0
setuptools==65.5.0
torch==2.13.0+cu128
triton==3.7.1
"""


def test_lockcheck_accepts_a_locked_freeze() -> None:
    assert lockcheck.check(GOOD_FREEZE, LOCK_TEXT) == []
    assert lockcheck.check("torch==2.13.0+cpu\nNumPy==2.4.6\n", LOCK_TEXT) == []


def test_lockcheck_lists_each_mismatch() -> None:
    bad = (
        GOOD_FREEZE.replace("triton==3.7.1", "triton==3.9.0") + "requests==2.34.2\nzz @ file:///x\n"
    )
    bad = bad.replace("torch==2.13.0+cu128", "torch==2.12.0+cu128")
    assert lockcheck.check(bad, LOCK_TEXT) == [
        "requests==2.34.2: not in the lock",
        "torch==2.12.0+cu128: the lock has ==2.13.0",
        "triton==3.9.0: the lock has ==3.7.1",
        "zz (from a URL or path): not in the lock",
    ]
    # A lock that names a local label wants exactly that build.
    assert lockcheck.check("torch==2.13.0+cu128\n", "torch==2.13.0+cpu\n") == [
        "torch==2.13.0+cu128: the lock has ==2.13.0+cpu"
    ]


def test_lockcheck_rejects_malformed_input() -> None:
    with pytest.raises(ValueError, match="not name==version"):
        lockcheck.parse_lock("torch>=2.4\n")
    with pytest.raises(ValueError, match="pinned twice"):
        lockcheck.parse_lock("torch==2.13.0\nTorch==2.13.0\n")
    with pytest.raises(ValueError, match="not understood"):
        lockcheck.parse_freeze("torch>=2.4\n")


def _cli(tmp_path: Path, freeze: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "freeze.txt").write_text(freeze)
    (tmp_path / "constraints.txt").write_text(LOCK_TEXT)
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "lockcheck.py"), "--constraints"]
        + [str(tmp_path / "constraints.txt"), str(tmp_path / "freeze.txt")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_lockcheck_command(tmp_path: Path) -> None:
    good = _cli(tmp_path, GOOD_FREEZE)
    assert (good.returncode, good.stdout) == (0, ""), good.stderr
    bad = _cli(tmp_path, GOOD_FREEZE.replace("numpy==2.4.6", "numpy==2.4.5"))
    assert bad.returncode == 1, bad.stderr
    assert bad.stdout == "numpy==2.4.5: the lock has ==2.4.6\n"
    assert "1 distribution(s) differ" in bad.stderr
    broken = _cli(tmp_path, "not a pin\n")
    assert broken.returncode == 2 and "not understood" in broken.stderr


def test_lockcheck_passes_the_lock_itself() -> None:
    """The lock read as a freeze meets itself: the command the image test runs works on it."""
    assert lockcheck.check(LOCK_PATH.read_text(), LOCK_PATH.read_text()) == []


# ---- (c) the Dockerfiles: FAILS until every image installs with `-c constraints.txt` ------------


def _pip_installs(tokens: list[str]) -> list[list[str]]:
    """The argument lists of each `pip install` (or `python -m pip install`) in a RUN's tokens."""
    found = []
    for i, token in enumerate(tokens[:-1]):
        if token.endswith("pip") and tokens[i + 1] == "install":
            args = []
            for arg in tokens[i + 2 :]:
                if arg in ("&&", "||", ";", "|") or arg.endswith(";"):
                    break
                args.append(arg)
            found.append(args)
    return found


def _constraint_files(args: list[str]) -> list[str]:
    files = []
    for i, arg in enumerate(args):
        if arg in ("-c", "--constraint") and i + 1 < len(args):
            files.append(args[i + 1])
        elif arg.startswith("--constraint="):
            files.append(arg.split("=", 1)[1])
        elif arg.startswith("-c") and len(arg) > 2:
            files.append(arg[2:])
    return files


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_c_every_dockerfile_installs_with_the_lock(dockerfile: Path) -> None:
    """(c) Each `pip install` in each Dockerfile passes `-c .../constraints.txt`, and the lock was
    copied into the stage before it (the torch install comes before the closure's COPYs)."""
    problems = []
    copied = False
    for ins in closure.parse_dockerfile(dockerfile.read_text()):
        if ins.keyword == "FROM":
            copied = False
        if ins.keyword in ("COPY", "ADD"):
            tokens = shlex.split(ins.args)
            sources = [t for t in tokens if not t.startswith("--")][:-1]
            copied |= any(Path(s).name == "constraints.txt" for s in sources)
        if ins.keyword != "RUN":
            continue
        for args in _pip_installs(shlex.split(ins.args)):
            files = _constraint_files(args)
            if not any(Path(f).name == "constraints.txt" for f in files):
                problems.append(f"line {ins.line}: pip install without -c constraints.txt")
            elif not copied:
                problems.append(f"line {ins.line}: constraints.txt is not copied in before")
    assert problems == [], f"{dockerfile.relative_to(ROOT)}: " + "; ".join(problems)
