"""The local distributions a service installs, read from the pyproject files (one source of truth).

    python scripts/closure.py decode         protos kernels engine services/common services/decode
    python scripts/closure.py --pip kvstore  ./protos ./services/common ./services/kvstore
    python scripts/closure.py --check        each services/*/Dockerfile copies and pip-installs
                                             exactly its closure (else exit 1, one line per defect)

A closure is the set of local distributions (folders holding a pyproject.toml) reachable from one
distribution through `[project] dependencies` and the extras those requirements name
(`pdmesh-service[worker]` pulls in `pdmesh-engine[runtime]`, which pulls in `pdmesh-kernels`). It
is printed in install order: every folder after the folders it depends on. Requirements on
anything that is not a local distribution (grpcio, torch, ...) are third-party: pip resolves them.

Standard library only (tomllib: Python >= 3.11), so it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("gateway", "kvstore", "eplb", "prefill", "decode")
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")
_SHELL_OPERATORS = frozenset({"&&", "||", ";", "|"})


def normalize(name: str) -> str:
    """PEP 503 name: `Pdmesh_Service` and `pdmesh-service` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Requirement:
    name: str  # normalized
    extras: tuple[str, ...]  # normalized, as written
    text: str  # the requirement as the pyproject spells it


def parse_requirement(text: str) -> Requirement:
    """Name and extras of a PEP 508 requirement; versions and markers are kept only in `text`."""
    match = _REQUIREMENT.match(text)
    if match is None:
        raise ValueError(f"not a requirement: {text!r}")
    extras = tuple(normalize(e) for e in (match.group(2) or "").split(",") if e.strip())
    return Requirement(normalize(match.group(1)), extras, text.strip())


@dataclass(frozen=True)
class Distribution:
    name: str  # normalized project name
    folder: str  # "/"-separated, from the root ("." for the root)
    requires: tuple[Requirement, ...]  # [project] dependencies
    extras: dict[str, tuple[Requirement, ...]]  # [project.optional-dependencies], normalized keys


def read_distribution(root: Path, pyproject: Path) -> Distribution:
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = {
        normalize(k): tuple(parse_requirement(r) for r in v)
        for k, v in project.get("optional-dependencies", {}).items()
    }
    requires = tuple(parse_requirement(r) for r in project.get("dependencies", []))
    folder = pyproject.parent.relative_to(root).as_posix()
    return Distribution(normalize(project["name"]), folder, requires, extras)


def discover(root: Path = ROOT) -> dict[str, Distribution]:
    """Every local distribution by normalized name: the root, top folders, services/ folders."""
    paths = [
        root / "pyproject.toml",
        *sorted(root.glob("*/pyproject.toml")),
        *sorted(root.glob("services/*/pyproject.toml")),
    ]
    found: dict[str, Distribution] = {}
    for path in paths:
        if not path.is_file() or any(p.startswith(".") for p in path.relative_to(root).parts):
            continue
        dist = read_distribution(root, path)
        if dist.name in found:
            first = found[dist.name].folder
            raise ValueError(f"{dist.name} is declared twice: {first}, {dist.folder}")
        found[dist.name] = dist
    return found


def resolve(dists: dict[str, Distribution], target: str) -> Distribution:
    """`decode`, `services/decode` or `pdmesh-decode` → that distribution."""
    by_folder = {d.folder: d for d in dists.values()}
    for key in (f"services/{target}", target.strip("/")):
        if key in by_folder:
            return by_folder[key]
    if normalize(target) in dists:
        return dists[normalize(target)]
    raise ValueError(f"no local distribution named {target!r}; known: {sorted(by_folder)}")


def requirements_of(dist: Distribution, extras: set[str]) -> list[Requirement]:
    """Base requirements, then those of each active extra in declaration order."""
    chosen = (r for name, reqs in dist.extras.items() if name in extras for r in reqs)
    return [*dist.requires, *chosen]


def _active_extras(dists: dict[str, Distribution], start: Distribution) -> dict[str, set[str]]:
    """Fixpoint: each reachable local distribution → the extras reachable requirements ask of it."""
    active: dict[str, set[str]] = {start.name: set()}
    changed = True
    while changed:
        changed = False
        for name, extras in list(active.items()):
            for req in requirements_of(dists[name], extras):
                if req.name not in dists:
                    continue
                if unknown := set(req.extras) - set(dists[req.name].extras):
                    raise ValueError(
                        f"{dists[name].folder}: {req.text} names unknown extras {sorted(unknown)}"
                    )
                if req.name not in active or not active[req.name].issuperset(req.extras):
                    active.setdefault(req.name, set()).update(req.extras)
                    changed = True
    return active


def closure(target: str, root: Path = ROOT) -> list[Distribution]:
    """The local distributions `target` installs, itself included, each after its dependencies."""
    dists = discover(root)
    start = resolve(dists, target)
    active = _active_extras(dists, start)
    order: list[Distribution] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:  # depth-first post-order, requirements in declared order
        if any(d.name == name for d in order):
            return
        if name in visiting:
            raise ValueError(f"dependency cycle through {dists[name].folder}")
        visiting.add(name)
        for req in requirements_of(dists[name], active[name]):
            if req.name in dists:
                visit(req.name)
        visiting.discard(name)
        order.append(dists[name])

    visit(start.name)
    return order


def closure_folders(target: str, root: Path = ROOT) -> list[str]:
    return [d.folder for d in closure(target, root)]


def third_party_requirements(target: str, root: Path = ROOT) -> list[Requirement]:
    """Requirements of the closure (extras resolved) that no local distribution satisfies."""
    dists = discover(root)
    active = _active_extras(dists, resolve(dists, target))
    return [
        r
        for d in closure(target, root)
        for r in requirements_of(d, active[d.name])
        if r.name not in dists
    ]


# ---- Dockerfiles --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, COPY, RUN, ...
    args: str  # the rest of the logical line, continuations joined
    line: int  # 1-based line of its first physical line


def parse_dockerfile(text: str) -> list[Instruction]:
    """Logical instructions: `\\` continuations joined, comments and blank lines dropped."""
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not parts:
            start = number
        is_continued = stripped.endswith("\\")
        parts.append(stripped[:-1].strip() if is_continued else stripped)
        if not is_continued:
            keyword, _, args = " ".join(parts).partition(" ")
            instructions.append(Instruction(keyword.upper(), args.strip(), start))
            parts = []
    if parts:
        raise ValueError(f"line {start}: the file ends inside a continued instruction")
    return instructions


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    """The instructions from the last FROM on (the image that is shipped)."""
    starts = [i for i, ins in enumerate(instructions) if ins.keyword == "FROM"]
    if not starts:
        raise ValueError("no FROM instruction")
    return instructions[starts[-1] :]


def copies(instructions: list[Instruction]) -> list[tuple[str, str]]:
    """(source, destination) of each COPY from the context (not `--from=stage`), no end `/`."""
    pairs: list[tuple[str, str]] = []
    for ins in instructions:
        if ins.keyword not in ("COPY", "ADD"):
            continue
        tokens = shlex.split(ins.args)
        if any(t.startswith("--from") for t in tokens):
            continue
        paths = [t for t in tokens if not t.startswith("--")]
        if len(paths) != 2:
            raise ValueError(f"line {ins.line}: one folder per COPY (several sources merge)")
        pairs.append((paths[0].rstrip("/") or "/", paths[1].rstrip("/") or "/"))
    return pairs


# what every image's builder stage copies besides its closure: deploy/image/ (builder.sh, worker.sh
# and the local wheelhouse) and the lock every pip install is held to
BUILD_SUPPORT = {"deploy/image": "/opt/build", "constraints.txt": "/opt/build/constraints.txt"}
CONSTRAINT = "-c /opt/build/constraints.txt"


def closure_copies(instructions: list[Instruction]) -> list[tuple[str, str]]:
    """`copies` less the build-support ones (`BUILD_SUPPORT`)."""
    return [(s, d) for s, d in copies(instructions) if s not in BUILD_SUPPORT]


def unconstrained_installs(instructions: list[Instruction]) -> list[int]:
    """Lines of RUNs that call `pip install` without the lock (`CONSTRAINT`)."""
    return [
        ins.line
        for ins in instructions
        if ins.keyword == "RUN"
        and re.search(r"pip install\b", ins.args)
        and CONSTRAINT not in ins.args
    ]


def pip_installed_paths(instructions: list[Instruction]) -> list[str]:
    """Local paths (`./x`) that RUN lines pass to `pip install`, in order, as `x`."""
    found: list[str] = []
    for ins in instructions:
        if ins.keyword != "RUN":
            continue
        tokens = shlex.split(ins.args)
        for i, token in enumerate(tokens[:-1]):
            if not (token.endswith("pip") and tokens[i + 1] == "install"):
                continue
            for arg in tokens[i + 2 :]:
                if arg in _SHELL_OPERATORS:
                    break
                if arg.startswith("./"):
                    found.append(arg[2:].rstrip("/"))
    return found


def check_dockerfile(service: str, root: Path = ROOT) -> list[str]:
    """Defects of services/<service>/Dockerfile against the closure; empty when there are none."""
    path = root / "services" / service / "Dockerfile"
    where = path.relative_to(root).as_posix()
    if not path.is_file():
        return [f"{where}: missing"]
    instructions = parse_dockerfile(path.read_text())
    expected = closure_folders(service, root)
    problems: list[str] = []
    support = [(s, d) for s, d in copies(instructions) if s in BUILD_SUPPORT]
    if sorted(support) != sorted(BUILD_SUPPORT.items()):
        problems.append(
            f"{where}: COPY {support} != the build support {sorted(BUILD_SUPPORT.items())}"
        )
    problems += [
        f"{where}:{n}: pip install without {CONSTRAINT}"
        for n in unconstrained_installs(instructions)
    ]
    pairs = closure_copies(instructions)
    copied = [source for source, _ in pairs]
    if sorted(copied) != sorted(expected):
        problems.append(f"{where}: COPY {copied} != closure {expected}")
    problems += [f"{where}: COPY {s} lands at {d}, not at {s}" for s, d in pairs if d != s]
    installed = pip_installed_paths(instructions)
    if installed != expected:
        problems.append(f"{where}: pip install {installed} != closure {expected} (install order)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "target", nargs="?", help="a service (decode), folder (services/decode) or project name"
    )
    parser.add_argument("--pip", action="store_true", help="print the folders as ./folder")
    parser.add_argument(
        "--check", action="store_true", help="check every service's Dockerfile against its closure"
    )
    args = parser.parse_args(argv)
    if args.check:
        problems = [p for service in SERVICES for p in check_dockerfile(service)]
        for problem in problems:
            print(problem, file=sys.stderr)
        if not problems:
            print(f"ok: {len(SERVICES)} Dockerfiles install exactly their closure")
        return 1 if problems else 0
    if not args.target:
        parser.error("give a target or --check")
    try:
        folders = closure_folders(args.target)
    except ValueError as e:
        parser.error(str(e))
    print(" ".join(f"./{f}" if args.pip else f for f in folders))
    return 0


if __name__ == "__main__":
    sys.exit(main())
