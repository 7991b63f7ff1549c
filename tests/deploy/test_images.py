"""The service images, read statically (no docker, no network).

Each Dockerfile copies and installs exactly its service's closure (scripts/closure.py, computed from
the pyproject files), the light images hold no torch, and the shipped stage runs as a non-root user
with a gRPC health check and an entry module that exists.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "kvstore", "eplb", "prefill", "decode")
TORCH_FREE = ("gateway", "kvstore", "eplb")
WORKERS = ("prefill", "decode")
ACCELERATOR_DISTRIBUTIONS = {"torch", "triton", "nixl", "nixl-cu12", "nixl-cu13"}


def _load_closure() -> ModuleType:
    """scripts/closure.py (scripts/ is not a package: loaded from its file, once)."""
    name = "pdmesh_closure_script"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "closure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


closure = _load_closure()


def _instructions(service: str) -> list[Any]:
    text = (ROOT / "services" / service / "Dockerfile").read_text()
    parsed: list[Any] = closure.parse_dockerfile(text)
    return parsed


def _one(instructions: list[Any], keyword: str) -> Any:
    found = [i for i in instructions if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword} in the shipped stage, found {len(found)}"
    return found[0]


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def _service_name(service: str) -> str:
    """SERVICE_NAME as the service's own code declares it (the health service name it serves)."""
    for path in sorted((ROOT / "services" / service / f"pdmesh_{service}").glob("*.py")):
        match = re.search(r'^SERVICE_NAME\s*=\s*"([^"]+)"', path.read_text(), re.MULTILINE)
        if match:
            return match.group(1)
    raise AssertionError(f"no SERVICE_NAME in services/{service}")


def _flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


# ---- scripts/closure.py itself ------------------------------------------------------------------


def test_closure_resolves_extras_in_install_order() -> None:
    assert closure.closure_folders("decode") == [
        "protos",
        "kernels",
        "engine",
        "services/common",
        "services/decode",
    ]
    assert closure.closure_folders("pdmesh-kvstore") == [
        "protos",
        "services/common",
        "services/kvstore",
    ]
    assert "kernels" not in closure.closure_folders("gateway"), "the engine without [runtime]"


def _write_project(
    folder: Path, name: str, deps: list[str], extras: dict[str, list[str]] | None = None
) -> None:
    folder.mkdir(parents=True)
    lines = [f'[project]\nname = "{name}"\ndependencies = {json.dumps(deps)}\n']
    if extras:
        lines.append("[project.optional-dependencies]\n")
        lines += [f"{k} = {json.dumps(v)}\n" for k, v in extras.items()]
    (folder / "pyproject.toml").write_text("".join(lines))


def test_closure_activates_an_extra_asked_for_after_its_distribution(tmp_path: Path) -> None:
    _write_project(tmp_path / "low", "low", ["numpy"], {"heavy": ["extra-dep", "torch>=2"]})
    _write_project(tmp_path / "extra", "extra-dep", [])
    _write_project(tmp_path / "mid", "Mid_Dist", ["low"])
    # `low` is reached plain through mid-dist first; low[heavy] then adds extra-dep before it.
    _write_project(tmp_path / "services" / "app", "app", ["mid-dist", "low[heavy]"])
    assert closure.closure_folders("app", tmp_path) == ["extra", "low", "mid", "services/app"]
    names = {r.name for r in closure.third_party_requirements("app", tmp_path)}
    assert names == {"numpy", "torch"}
    assert closure.closure_folders("mid", tmp_path) == ["low", "mid"]


def test_closure_rejects_an_unknown_extra(tmp_path: Path) -> None:
    _write_project(tmp_path / "low", "low", [])
    _write_project(tmp_path / "top", "top", ["low[nope]"])
    with pytest.raises(ValueError, match="unknown extras"):
        closure.closure("top", tmp_path)


def test_check_mode_passes_on_the_repository() -> None:
    assert closure.main(["--check"]) == 0


# ---- each Dockerfile ----------------------------------------------------------------------------


@pytest.mark.parametrize("service", SERVICES)
def test_copy_sources_exist_and_equal_the_closure(service: str) -> None:
    pairs = closure.closure_copies(_instructions(service))
    for source, destination in pairs:
        assert (ROOT / source / "pyproject.toml").is_file(), f"COPY {source}: no distribution"
        assert destination == source, f"COPY {source} lands at {destination}"
    expected = closure.closure_folders(service)
    assert sorted(s for s, _ in pairs) == sorted(expected)
    assert closure.pip_installed_paths(_instructions(service)) == expected
    assert closure.check_dockerfile(service) == []


def _ignore_patterns() -> list[str]:
    text = (ROOT / ".dockerignore").read_text()
    return [p.strip() for p in text.splitlines() if p.strip() and not p.startswith("#")]


@pytest.mark.parametrize("service", SERVICES)
def test_the_build_context_keeps_the_closure(service: str) -> None:
    """No root .dockerignore pattern drops a closure folder or one above it."""
    patterns = _ignore_patterns()
    assert not any(p.startswith("!") for p in patterns), "a deny list: no re-includes to check"
    for folder in closure.closure_folders(service):
        parts = folder.split("/")
        for above in ("/".join(parts[:n]) for n in range(1, len(parts) + 1)):
            hits = [
                p
                for p in patterns
                if fnmatch.fnmatch(above, p.removeprefix("**/")) or fnmatch.fnmatch(above, p)
            ]
            assert hits == [], f".dockerignore {hits} drops {above}"


def test_the_build_context_leaves_out_local_build_output() -> None:
    assert {".git", "**/.venv", "**/*.egg-info", "**/build"} <= set(_ignore_patterns())


@pytest.mark.parametrize("service", TORCH_FREE)
def test_light_images_install_no_torch(service: str) -> None:
    names = {r.name for r in closure.third_party_requirements(service)}
    assert not names & ACCELERATOR_DISTRIBUTIONS, f"{service} pulls {names}"
    assert "kernels" not in closure.closure_folders(service)
    text = (ROOT / "services" / service / "Dockerfile").read_text().lower()
    assert "torch" not in re.sub(r"#.*", "", text), "a light image names torch outside comments"


@pytest.mark.parametrize("service", WORKERS)
def test_worker_images_install_torch_first_from_build_arguments(service: str) -> None:
    names = {r.name for r in closure.third_party_requirements(service)}
    assert {"torch", "nixl"} <= names and "triton" not in names  # CUDA torch brings triton
    instructions = _instructions(service)
    args = dict(i.args.partition("=")[::2] for i in instructions if i.keyword == "ARG")
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_SPEC"] == "torch==2.13.0+cpu"  # the CPU build by default
    assert args["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert args["VARIANT"] == "cpu"
    torch_run = next(
        n for n, i in enumerate(instructions) if i.keyword == "RUN" and "TORCH_SPEC" in i.args
    )
    first_copy = next(
        n
        for n, i in enumerate(instructions)
        if i.keyword == "COPY" and i.args.split()[0].rstrip("/") not in closure.BUILD_SUPPORT
    )
    assert torch_run < first_copy, "torch is installed before the closure"
    # one NIXL build and the CPU layer kernel compiled in the builder stage, after the install
    runs = [i.args for i in instructions if i.keyword == "RUN"]
    assert runs[-2:] != [] and any("worker.sh" in r for r in runs)
    worker_sh = (ROOT / "deploy" / "image" / "worker.sh").read_text()
    assert "pdmesh_kernels.cpu_layers --prebuild" in worker_sh
    assert "builder.sh --compiler" in " ".join(runs)


@pytest.mark.parametrize("service", SERVICES)
def test_no_index_host_is_written(service: str) -> None:
    text = (ROOT / "services" / service / "Dockerfile").read_text()
    hosts = re.findall(r"\b(?!redis)[a-z]+://[^/\s]*", text)
    assert set(hosts) <= {"https://download.pytorch.org"}, hosts  # PyTorch's own index only


@pytest.mark.parametrize("service", SERVICES)
def test_shipped_stage_runs_as_non_root(service: str) -> None:
    final = closure.final_stage(_instructions(service))
    user = _one(final, "USER").args.split(":")[0]
    assert user not in ("", "root", "0"), f"USER {user}"


@pytest.mark.parametrize("service", SERVICES)
def test_healthcheck_asks_the_service_on_its_port(service: str) -> None:
    final = closure.final_stage(_instructions(service))
    options, _, command = _one(final, "HEALTHCHECK").args.partition("CMD ")
    probe = _exec_form(command)
    assert probe[:3] == ["python", "-m", "pdmesh_service.healthcheck"]
    assert (ROOT / "services" / "common" / "pdmesh_service" / "healthcheck.py").is_file()
    assert _flag(probe, "--service") == _service_name(service)
    port = _flag(probe, "--address").rsplit(":", 1)[1]
    cmd = _exec_form(_one(final, "CMD").args)
    assert _flag(cmd, "--port") == port
    assert port in _one(final, "EXPOSE").args.split()
    assert "--start-period=" in options


@pytest.mark.parametrize("service", SERVICES)
def test_entrypoint_runs_the_service_module_on_all_interfaces(service: str) -> None:
    final = closure.final_stage(_instructions(service))
    assert _exec_form(_one(final, "ENTRYPOINT").args) == ["python", "-m", f"pdmesh_{service}"]
    assert (ROOT / "services" / service / f"pdmesh_{service}" / "__main__.py").is_file()
    cmd = _exec_form(_one(final, "CMD").args)
    assert _flag(cmd, "--host") == "0.0.0.0"
    assert _flag(cmd, "--redis-url").startswith("redis://")
    if service in ("gateway", *WORKERS):
        assert _flag(cmd, "--model") == "/model"


# ---- what a build without a registry and a compose build need ------------------------------------

DOCKERFILES = [ROOT / "services" / s / "Dockerfile" for s in SERVICES] + [
    ROOT / "deploy" / "cli.Dockerfile"
]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name + "/" + p.name)
def test_no_frontend_is_fetched_and_every_install_is_locked(path: Path) -> None:
    """A `# syntax=` line makes BuildKit pull its frontend from a registry: with none reachable the
    build fails before its first step. Every pip install is held to constraints.txt."""
    text = path.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE)
    instructions = closure.parse_dockerfile(text)
    assert closure.unconstrained_installs(instructions) == []
    support = [i for i in instructions if i.keyword == "COPY" and "/opt/build" in i.args]
    copied = dict(closure.copies(support))
    assert {k: copied.get(k) for k in closure.BUILD_SUPPORT} == closure.BUILD_SUPPORT
    assert "--index-url" not in text  # an extra index, never one that replaces PyPI


def test_the_cli_image_pins_torch_to_the_cpu_build() -> None:
    instructions = closure.parse_dockerfile((ROOT / "deploy" / "cli.Dockerfile").read_text())
    args = dict(i.args.partition("=")[::2] for i in instructions if i.keyword == "ARG")
    assert args["TORCH_SPEC"] == "torch==2.13.0+cpu"
    assert args["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


def _compose() -> dict[str, Any]:
    import yaml

    parsed: dict[str, Any] = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    return parsed


def test_compose_passes_each_image_its_build_arguments() -> None:
    """`docker compose up --build` builds what `docker build` would with the same variables: every
    ARG a Dockerfile declares (BASE_IMAGE, TORCH_SPEC, ...) comes from the variable of its name."""
    built = {n: s for n, s in _compose()["services"].items() if "build" in s}
    assert set(built) == {*SERVICES, "model-init"}
    for name, service in built.items():
        dockerfile = ROOT / service["build"]["dockerfile"]
        declared = {
            i.args.partition("=")[0]
            for i in closure.parse_dockerfile(dockerfile.read_text())
            if i.keyword == "ARG"
        }
        passed = service["build"].get("args", {})
        assert set(passed) == declared, (name, passed, declared)
        for arg, value in passed.items():
            assert re.fullmatch(r"\$\{" + arg + r"(:?-[^}]*)?\}", value), (name, arg, value)


def test_the_control_plane_comes_up_without_the_workers() -> None:
    services = _compose()["services"]
    for name in ("gateway", "kvstore", "eplb"):
        assert not {"prefill", "decode"} & set(services[name].get("depends_on", {})), name
    for name in SERVICES:  # a killed service comes back by itself
        assert services[name]["restart"] == "unless-stopped"
    assert services["redis"]["image"].startswith("${REDIS_IMAGE:-")


def test_kernels_need_no_triton_on_cpu() -> None:
    """PyTorch's CUDA builds bring triton; a CPU image installs none (999 MB)."""
    import tomllib

    kernels = tomllib.loads((ROOT / "kernels" / "pyproject.toml").read_text())["project"]
    assert not any(r.startswith("triton") for r in kernels["dependencies"])
    assert any(r.startswith("triton") for r in kernels["optional-dependencies"]["triton"])
