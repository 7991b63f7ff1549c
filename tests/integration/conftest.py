"""Real meshes for end-to-end tests: processes started by the launcher on loopback, real Redis,
NIXL and gRPC, a tiny seeded model. One mesh per mode, shared by the tests of a session."""

from __future__ import annotations

from pathlib import Path

import pytest
from meshlib import WORKER_ARGS

from pdmesh.launcher import Mesh, MeshOptions
from pdmesh_service.redis_server import free_port


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdmesh.tools.model_init import init_model

    return init_model(
        tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0, verbose=False
    )


@pytest.fixture(scope="session")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny seeded DeepSeek-V4 checkpoint (every layer kind, hash and top-k MoE, an MTP layer)."""
    from pdmesh.tools.model_init import init_model

    root = tmp_path_factory.mktemp("model-v4")
    return init_model(root / "tiny-v4", "tiny", seed=3, arch="deepseek_v4", verbose=False)


def _start(mode: str, model: Path, log_dir: Path) -> Mesh:
    options = MeshOptions(
        model_dir=model,
        num_prefill=1,
        num_decode=1,
        mode=mode,
        http_port=free_port(),
        grpc_port=free_port(),
        deployment=f"test-{mode}",
        log_dir=log_dir,
        worker_args=WORKER_ARGS,
    )
    mesh = Mesh(options)
    mesh.start(timeout_s=240, progress=lambda line: None)
    return mesh


@pytest.fixture(scope="session")
def disagg_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    mesh = _start("disagg", tiny_model, tmp_path_factory.mktemp("logs-disagg"))
    yield mesh
    mesh.stop()


@pytest.fixture(scope="session")
def agg_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    mesh = _start("agg", tiny_model, tmp_path_factory.mktemp("logs-agg"))
    yield mesh
    mesh.stop()
