"""Common service options: flags over PDMESH_* environment defaults over built-in defaults."""

from __future__ import annotations

import argparse
import socket

import pytest

from pdmesh_service.options import CommonConfig, add_common_arguments, common_from_args


def _parse(argv: list[str], environ: dict[str, str]) -> CommonConfig:
    parser = argparse.ArgumentParser()
    add_common_arguments(parser, environ)
    return common_from_args(parser.parse_args(argv))


def test_environment_gives_defaults_and_flags_win() -> None:
    env = {
        "PDMESH_REDIS_URL": "redis://redis:6379/0",
        "PDMESH_METRICS_PORT": "9090",
        "PDMESH_ADVERTISE_HOST": "decode-0",
        "PDMESH_DEPLOYMENT": "prod",
    }
    config = _parse([], env)
    assert (config.redis_url, config.metrics_port, config.deployment) == (
        "redis://redis:6379/0",
        9090,
        "prod",
    )
    assert config.address(50051) == "decode-0:50051"
    assert _parse(["--redis-url", "redis://other:1/0"], env).redis_url == "redis://other:1/0"
    assert _parse([], {}).redis_url == "redis://127.0.0.1:6379/0"


def test_a_bad_environment_value_fails_like_a_bad_flag() -> None:
    with pytest.raises(SystemExit):
        _parse([], {"PDMESH_PORT": "not-a-port"})
    with pytest.raises(ValueError, match="--redis-url"):
        _parse([], {"PDMESH_REDIS_URL": "http://x"})


def test_a_wildcard_bind_advertises_this_machines_address() -> None:
    assert CommonConfig(host="127.0.0.1").address(7) == "127.0.0.1:7"
    own = socket.gethostbyname(socket.gethostname())
    assert CommonConfig(host="0.0.0.0").address(7) == f"{own}:7"
    assert CommonConfig(host="0.0.0.0", advertise_host="10.1.2.3").address(7) == "10.1.2.3:7"
    assert CommonConfig(host="::1").address(7) == "[::1]:7"


def test_a_second_server_on_a_port_in_use_fails_at_start() -> None:
    import asyncio

    from pdmesh_service.grpc_server import start_grpc_server

    async def main() -> str:
        first = await start_grpc_server("127.0.0.1", 0, [], [])
        try:
            with pytest.raises(OSError, match="in use") as error:
                await start_grpc_server("127.0.0.1", first.port, [], [])
            return str(error.value)
        finally:
            await first.stop()

    assert "127.0.0.1" in asyncio.run(main())
