"""Check installed distributions against the lock (constraints.txt, written by scripts/lock.sh).

    python scripts/lockcheck.py FREEZE_FILE       # a `pip freeze` output from inside an image
    docker run --rm --entrypoint pip IMAGE freeze | python scripts/lockcheck.py -
    python scripts/lockcheck.py --constraints OTHER.txt FREEZE_FILE

Exit 0 when every third-party distribution in FREEZE_FILE is in the lock at the lock's version;
exit 1 listing each one that is not (a different version, or one the lock does not name); exit 2
when a file cannot be read or is malformed. The project's own distributions (pdmesh, pdmesh-*) and
pip/setuptools/wheel are not checked, whatever form pip prints them in (`name==version`,
`name @ file:///src/...`, `-e ...`). A locked version without a local label is met by any local
label of that version, as pip's `==` is (the lock's `torch==2.13.0` by 2.13.0+cpu or +cu128).

Standard library only, so it runs with any Python 3.11+.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "constraints.txt"
UNLOCKED = frozenset({"pip", "setuptools", "wheel"})
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")
_DIRECT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*@\s*\S+$")


def normalize(name: str) -> str:
    """PEP 503 name: `Typing_Extensions` and `typing-extensions` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def is_exempt(name: str) -> bool:
    """The project's own distributions and the installer's tools: never in the lock."""
    name = normalize(name)
    return name in UNLOCKED or name == "pdmesh" or name.startswith("pdmesh-")


def parse_lock(text: str) -> dict[str, str]:
    """constraints.txt → {normalized name: version}; ValueError on a line that is not a pin."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _PIN.match(line)
        if match is None:
            raise ValueError(f"lock line {number}: not name==version: {raw!r}")
        name = normalize(match.group(1))
        if name in pins:
            raise ValueError(f"lock line {number}: {name} is pinned twice")
        pins[name] = match.group(2)
    return pins


def parse_freeze(text: str) -> dict[str, str | None]:
    """`pip freeze` (or `pip list --format=freeze`) → {normalized name: version}, None for a
    distribution installed from a URL or path (`name @ url`). Editable (`-e`) lines, options and
    comments are skipped: only the project's own distributions are installed that way."""
    found: dict[str, str | None] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", "-")):
            continue
        if match := _PIN.match(line):
            found[normalize(match.group(1))] = match.group(2)
        elif match := _DIRECT.match(line):
            found[normalize(match.group(1))] = None
        else:
            raise ValueError(f"freeze line {number}: not understood: {raw!r}")
    return found


def version_matches(installed: str, locked: str) -> bool:
    """`installed` meets `==locked`: equal, or equal but for a local label the lock leaves out."""
    if installed.lower() == locked.lower():
        return True
    return "+" not in locked and installed.split("+", 1)[0].lower() == locked.lower()


def mismatches(installed: dict[str, str | None], lock: dict[str, str]) -> list[str]:
    """One line per installed third-party distribution the lock does not hold at its version."""
    problems: list[str] = []
    for name in sorted(installed):
        if is_exempt(name):
            continue
        version = installed[name]
        if name not in lock:
            shown = f"=={version}" if version is not None else " (from a URL or path)"
            problems.append(f"{name}{shown}: not in the lock")
        elif version is None:
            problems.append(f"{name}: installed from a URL or path, the lock has =={lock[name]}")
        elif not version_matches(version, lock[name]):
            problems.append(f"{name}=={version}: the lock has =={lock[name]}")
    return problems


def check(freeze_text: str, lock_text: str) -> list[str]:
    """The mismatches between a `pip freeze` output and a lock file's text (empty: all locked)."""
    return mismatches(parse_freeze(freeze_text), parse_lock(lock_text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("freeze", help="a `pip freeze` output file, or - for standard input")
    parser.add_argument("--constraints", type=Path, default=LOCK, help="the lock (constraints.txt)")
    args = parser.parse_args(argv)
    try:
        freeze_text = sys.stdin.read() if args.freeze == "-" else Path(args.freeze).read_text()
        problems = check(freeze_text, args.constraints.read_text())
    except (OSError, ValueError) as e:
        print(f"lockcheck: {e}", file=sys.stderr)
        return 2
    for problem in problems:
        print(problem)
    if problems:
        print(
            f"lockcheck: {len(problems)} distribution(s) differ from {args.constraints.name}"
            " (install with `pip install -c constraints.txt ...`; refresh: bash scripts/lock.sh)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
