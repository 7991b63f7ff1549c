"""The tree is the card's: one distribution per folder, import rules that hold, torch-free light
services."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = {  # folder -> (distribution, import package)
    "protos": ("pdmesh-proto", "pdmesh_proto"),
    "kernels": ("pdmesh-kernels", "pdmesh_kernels"),
    "engine": ("pdmesh-engine", "pdmesh_engine"),
    "services/common": ("pdmesh-service", "pdmesh_service"),
    "services/gateway": ("pdmesh-gateway", "pdmesh_gateway"),
    "services/kvstore": ("pdmesh-kvstore", "pdmesh_kvstore"),
    "services/eplb": ("pdmesh-eplb", "pdmesh_eplb"),
    "services/prefill": ("pdmesh-prefill", "pdmesh_prefill"),
    "services/decode": ("pdmesh-decode", "pdmesh_decode"),
    "sdk": ("pdmesh-client", "pdmesh_client"),
    "bench": ("pdmesh-bench", "pdmesh_bench"),
}
TORCH_FREE = ["pdmesh_gateway", "pdmesh_kvstore", "pdmesh_eplb", "pdmesh_client", "pdmesh_proto"]


@pytest.mark.parametrize("folder", sorted(DISTRIBUTIONS))
def test_each_folder_is_a_distribution_of_its_own_package(folder: str) -> None:
    name, package = DISTRIBUTIONS[folder]
    project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
    assert project["name"] == name
    assert (ROOT / folder / package / "__init__.py").is_file()
    assert not any(
        "torch" in dep for dep in project.get("dependencies", []) if folder not in ("kernels",)
    ), "torch only in kernels and the engine's [runtime] extra"


def test_setup_installs_every_distribution() -> None:
    listed = subprocess.run(
        ["bash", str(ROOT / "scripts" / "distributions.sh")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert sorted(listed) == sorted(DISTRIBUTIONS)


@pytest.mark.parametrize("service", ["gateway", "kvstore", "eplb", "prefill", "decode"])
def test_each_service_runs_as_a_module(service: str) -> None:
    folder = ROOT / "services" / service / f"pdmesh_{service}"
    assert {"__main__.py", "server.py", "servicer.py"} <= {p.name for p in folder.iterdir()}


def test_import_contracts_hold() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("import-linter is not installed (scripts/setup.sh installs it)")
    result = subprocess.run([lint, "--no-cache"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("package", TORCH_FREE)
def test_light_services_import_no_torch(package: str) -> None:
    code = (
        f"import sys, importlib, pkgutil, {package}\n"
        f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
        "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
        "print(sorted(m for m in ('torch', 'triton', 'nixl', 'safetensors') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", (package, result.stdout)


def _module_imports(package: str, folder: Path) -> dict[str, set[str]]:
    """Each module of `package` -> the package's modules it imports, those imported only for type
    checking included (a circle there is still a circle in the design)."""
    modules = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    imports: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    imports[name].add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                imports[name].update(alias.name for alias in node.names)
        imports[name] &= modules.keys() - {name}
    return imports


def _circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in imports[module]:
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            group = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(imports):
        if module not in order:
            visit(module)
    return found


def test_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


# bench is left out: serve and dp_replay import each other inside functions (dp_replay is a mode of
# serve built on its sender and summaries), a circle still to untie
@pytest.mark.parametrize("folder", [*sorted(set(DISTRIBUTIONS) - {"bench"}), "."])
def test_no_import_circles(folder: str) -> None:
    package = DISTRIBUTIONS.get(folder, ("pdmesh", "pdmesh"))[1]
    assert _circles(_module_imports(package, ROOT / folder / package)) == []
