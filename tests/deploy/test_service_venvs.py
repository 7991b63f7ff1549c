"""Each light service's closure installs on its own and starts.

A fresh venv per service (no system site packages), the closure folders pip-installed non-editable
(third-party dependencies resolved by pip, held to constraints.txt), no torch, triton or NIXL
importable, then the service run from that venv against a real Redis and asked for gRPC health
through `python -m pdmesh_service.healthcheck` from the same venv: the Dockerfiles' builder stage
without docker. Skipped only when pip cannot reach a package index.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdmesh_service.redis_server import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parents[2]
LIGHT_SERVICES = ("gateway", "kvstore", "eplb")
FORBIDDEN_MODULES = ("torch", "triton", "nixl", "pdmesh_kernels", "safetensors")
MAX_VENV_BYTES = 300 << 20  # a torch install alone is several times this
START_TIMEOUT_S = 60.0
# What pip reports when it cannot reach an index (urllib3 and socket errors, retried, then given).
NETWORK_ERRORS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
    "connection broken by",
)


def closure_folders(service: str) -> list[str]:
    """scripts/closure.py's closure (scripts/ is not a package: loaded from its file, once)."""
    name = "pdmesh_closure_script"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "closure.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve their module through sys.modules
        spec.loader.exec_module(module)
    folders: list[str] = sys.modules[name].closure_folders(service)
    return folders


@dataclass(frozen=True)
class ServiceVenv:
    service: str
    path: Path

    @property
    def python(self) -> str:
        return str(self.path / "bin" / "python")


def _clean_env() -> dict[str, str]:
    """The environment less what would put the test venv's packages on the service's path."""
    hidden = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k not in hidden}


def _install(service: str, root: Path, folders: list[str]) -> ServiceVenv:
    """Copy the closure folders (as the Dockerfile's COPY does: no build output in the repository)
    and pip-install them into a fresh venv; skip on a network failure, fail on any other."""
    src = root / "src"
    for folder in folders:
        shutil.copytree(
            ROOT / folder,
            src / folder,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"),
        )
    venv = ServiceVenv(service, root / f"venv-{service}")
    subprocess.run([sys.executable, "-m", "venv", str(venv.path)], check=True, env=_clean_env())
    argv = [
        venv.python,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "-q",
        "-c",
        str(ROOT / "constraints.txt"),  # the lock, as the images install
        *(f"./{f}" for f in folders),
    ]
    result = subprocess.run(
        argv, cwd=src, capture_output=True, text=True, env=_clean_env(), timeout=480
    )
    if result.returncode != 0:
        output = result.stdout + result.stderr
        if any(marker in output for marker in NETWORK_ERRORS):
            pytest.skip(f"pip cannot reach a package index to install {service}'s dependencies")
        pytest.fail(f"pip install of {service}'s closure {folders} failed:\n{output[-4000:]}")
    return venv


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ServiceVenv]:
    """The three installs at once (each its own venv and copy; pip mostly waits on the index and
    on unpacking, so they overlap well); a skip or failure of one is raised here."""
    root = tmp_path_factory.mktemp("service-venvs")
    folders = {service: closure_folders(service) for service in LIGHT_SERVICES}
    with ThreadPoolExecutor(len(LIGHT_SERVICES)) as pool:
        futures = {s: pool.submit(_install, s, root / s, folders[s]) for s in LIGHT_SERVICES}
        return {service: future.result() for service, future in futures.items()}


@pytest.fixture(scope="module")
def redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """config.json and a tokenizer for the gateway, made in the test's own venv (it has torch)."""
    from pdmesh.tools.model_init import init_model

    directory = tmp_path_factory.mktemp("model") / "tiny"
    return init_model(directory, preset="tiny", seed=0, verbose=False)


def _run(venv: ServiceVenv, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [venv.python, *args],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=venv.path,
        timeout=60,
    )


def _health(venv: ServiceVenv, port: int, name: str) -> subprocess.CompletedProcess[str]:
    return _run(
        venv,
        "-m",
        "pdmesh_service.healthcheck",
        "--address",
        f"127.0.0.1:{port}",
        "--service",
        name,
        "--timeout",
        "3",
    )


def _wait_serving(venv: ServiceVenv, process: subprocess.Popen[str], port: int, name: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            stderr = process.stderr.read() if process.stderr else ""
            pytest.fail(f"{venv.service} exited with {process.returncode}:\n{stderr[-4000:]}")
        probe = _health(venv, port, name)
        if probe.returncode == 0:
            assert "SERVING" in probe.stdout
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{venv.service} not SERVING in {START_TIMEOUT_S}s: {probe.stderr.strip()}")
        time.sleep(0.3)


def _start(
    venv: ServiceVenv, port: int, redis: EmbeddedRedis, *extra: str
) -> subprocess.Popen[str]:
    argv = [
        venv.python,
        "-m",
        f"pdmesh_{venv.service}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--redis-url",
        redis.url,
        "--deployment",
        f"venv-{venv.service}",
        *extra,
    ]
    return subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_clean_env(),
        cwd=venv.path,
    )


def _stop(process: subprocess.Popen[str]) -> int:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@pytest.mark.parametrize("service", LIGHT_SERVICES)
def test_closure_installs_no_accelerator_stack(venvs: dict[str, ServiceVenv], service: str) -> None:
    venv = venvs[service]
    probe = (
        "import importlib.util, json\n"
        f"found = [m for m in {list(FORBIDDEN_MODULES)!r} if importlib.util.find_spec(m)]\n"
        "print(json.dumps(found))"
    )
    found = _run(venv, "-c", probe)
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout) == []
    for module in ("torch", "triton", "nixl"):
        attempt = _run(venv, "-c", f"import {module}")
        assert attempt.returncode != 0, f"{module} imports in {service}'s venv"
        assert "ModuleNotFoundError" in attempt.stderr
    where = _run(venv, "-c", f"import pdmesh_service, pdmesh_{service} as m; print(m.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv.path), "in the venv, not editable"
    consistent = _run(venv, "-m", "pip", "check", "--disable-pip-version-check")
    assert consistent.returncode == 0, consistent.stdout


@pytest.mark.parametrize("service", LIGHT_SERVICES)
def test_venv_stays_small(
    venvs: dict[str, ServiceVenv], service: str, record_property: Any
) -> None:
    path = venvs[service].path
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    listed = _run(
        venvs[service], "-m", "pip", "list", "--format=json", "--disable-pip-version-check"
    )
    record_property("venv_bytes", size)
    record_property("num_packages", len(json.loads(listed.stdout)))
    assert size < MAX_VENV_BYTES, f"{service}'s venv holds {size >> 20} MiB"


@pytest.mark.parametrize(
    ("service", "name"), [("kvstore", "pdmesh.kvstore.v1.KVStore"), ("eplb", "pdmesh.eplb.v1.Eplb")]
)
def test_service_starts_from_its_venv_and_serves_health(
    venvs: dict[str, ServiceVenv], redis: EmbeddedRedis, service: str, name: str
) -> None:
    venv, port = venvs[service], free_port()
    process = _start(venv, port, redis)
    try:
        _wait_serving(venv, process, port, name)
        unknown = _health(venv, port, "pdmesh.nothing.v1.Nothing")
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    finally:
        code = _stop(process)
    assert code == 0, "SIGTERM stops the service cleanly"
    gone = _health(venv, port, name)
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_gateway_starts_from_its_venv_and_answers(
    venvs: dict[str, ServiceVenv], redis: EmbeddedRedis, tiny_model: Path
) -> None:
    venv, port, http_port = venvs["gateway"], free_port(), free_port()
    process = _start(venv, port, redis, "--model", str(tiny_model), "--http-port", str(http_port))
    try:
        _wait_serving(venv, process, port, "pdmesh.gateway.v1.Generate")
        status, body = _get(f"http://127.0.0.1:{http_port}/health")
        assert (status, body["status"], body["decode"]) == (503, "unavailable", 0), "no decode"
        status, models = _get(f"http://127.0.0.1:{http_port}/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [tiny_model.name]
    finally:
        code = _stop(process)
    assert code == 0, "SIGTERM stops the gateway cleanly"
