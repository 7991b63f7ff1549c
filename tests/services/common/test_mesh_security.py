"""Mesh security settings: where the mesh token comes from, mTLS between services (a CA and
certificates made here with `cryptography`), and secrets kept out of reprs and logs (a real kvstore
process on a password-protected Redis, its log read back)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis as redis_sync
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh_kvstore import server as kvstore_server
from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from pdmesh_service.entry import serve_main
from pdmesh_service.grpc_server import MESH_TOKEN_METADATA, MeshAuth, channel
from pdmesh_service.healthcheck import check
from pdmesh_service.kvstore_client import KVStoreClient
from pdmesh_service.options import (
    CommonConfig,
    add_common_arguments,
    common_from_args,
    redacted_url,
)
from pdmesh_service.redis_server import EmbeddedRedis, free_port

KVSTORE = kvstore_server.SERVICE_NAME


def _parse(argv: list[str], environ: dict[str, str]) -> CommonConfig:
    parser = argparse.ArgumentParser()
    add_common_arguments(parser, environ)
    return common_from_args(parser.parse_args(argv), environ)


# ----- settings -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://pdmesh:s3cret@redis:6379/0", "redis://***@redis:6379/0"),
        ("redis://:s3cret@10.0.0.1:6379", "redis://***@10.0.0.1:6379"),
        ("rediss://redis:6380/0?password=s3cret&db=1", "rediss://redis:6380/0?password=***&db=1"),
        ("unix://pdmesh:s3cret@/run/redis.sock?db=0", "unix://***@/run/redis.sock?db=0"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://[::1:6379", "***"),  # does not parse: all of it hidden
    ],
)
def test_redacted_url_hides_credentials_and_nothing_else(url: str, shown: str) -> None:
    assert redacted_url(url) == shown


def test_the_mesh_token_comes_from_its_file_or_the_environment_never_a_flag(
    tmp_path: Path,
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  from-the-file\n")
    env = {"PDMESH_MESH_TOKEN": "from-the-env"}
    assert _parse([], env).mesh_token == "from-the-env"
    assert _parse(["--mesh-token-file", str(token_file)], env).mesh_token == "from-the-file"
    assert _parse([], {"PDMESH_MESH_TOKEN_FILE": str(token_file)}).mesh_token == "from-the-file"
    assert _parse([], {}).mesh_token == ""


def test_no_flag_takes_the_mesh_token_itself(capsys: pytest.CaptureFixture[str]) -> None:
    """argv is visible to every user of the host; nor does `--mesh-token` pass for an abbreviation
    of --mesh-token-file (which would name the secret as a path in its error)."""
    with pytest.raises(SystemExit) as exited:
        serve_main("kvstore", kvstore_server, ["--mesh-token", "tok-123"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --mesh-token" in capsys.readouterr().err


def test_a_bad_mesh_token_fails_without_showing_it(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        _parse(["--mesh-token-file", str(empty)], {})
    with pytest.raises(ValueError, match="cannot read") as missing:
        _parse(["--mesh-token-file", str(tmp_path / "missing")], {})
    assert "FileNotFoundError" in str(missing.value)
    with pytest.raises(ValueError, match="printable ASCII") as spaced:
        _parse([], {"PDMESH_MESH_TOKEN": "two words"})
    assert "two words" not in str(spaced.value)


def test_tls_takes_all_three_files(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    with pytest.raises(ValueError, match="together"):
        _parse(["--tls-cert", str(pem)], {})
    with pytest.raises(ValueError, match="no such file"):
        _parse(
            ["--tls-cert", str(pem), "--tls-key", str(pem), "--tls-ca", str(tmp_path / "no")], {}
        )
    env = {f"PDMESH_TLS_{name}": str(pem) for name in ("CERT", "KEY", "CA")}
    assert _parse([], env).has_tls


def test_reprs_show_no_secret() -> None:
    config = CommonConfig(redis_url="redis://pdmesh:pw-123456@redis:6379/0", mesh_token="tok-98765")
    text = repr(config)
    assert "pw-123456" not in text and "tok-98765" not in text
    assert "redis://***@redis:6379/0" in text and "deployment='default'" in text
    auth = MeshAuth("tok-98765", b"cert", b"key-bytes", b"ca")
    assert "tok-98765" not in repr(auth) and "key-bytes" not in repr(auth)
    with pytest.raises(ValueError) as bad:
        CommonConfig(redis_url="http://pdmesh:pw-123456@redis:6379/0")
    assert "pw-123456" not in str(bad.value) and "***@redis" in str(bad.value)


# ----- mTLS -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: tuple[Path, Path]  # (certificate, key): the kvstore's
    client: tuple[Path, Path]  # a worker's, signed by the same CA
    stranger: tuple[Path, Path]  # signed by another CA

    def auth(self, pair: tuple[Path, Path], token: str = "") -> MeshAuth:
        return MeshAuth(token, pair[0].read_bytes(), pair[1].read_bytes(), self.ca.read_bytes())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
) -> x509.Certificate:
    """A certificate for `subject`: a CA when `issuer` is None (self-signed), else a leaf for
    127.0.0.1 and localhost usable as server and client."""
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, signer = issuer if issuer is not None else (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key: Any) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    leaves: dict[str, tuple[Path, Path]] = {}
    cas = {}
    for ca_name in ("mesh-ca", "other-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _certificate(ca_name, ca_key, None)
        cas[ca_name] = _write(directory, ca_name, ca_cert, ca_key)[0]
        for leaf, ca_of in (
            ("kvstore", "mesh-ca"),
            ("worker", "mesh-ca"),
            ("stranger", "other-ca"),
        ):
            if ca_of == ca_name:
                key = ec.generate_private_key(ec.SECP256R1())
                cert = _certificate(leaf, key, (ca_cert.subject, ca_key))
                leaves[leaf] = _write(directory, leaf, cert, key)
    return Pki(cas["mesh-ca"], leaves["kvstore"], leaves["worker"], leaves["stranger"])


def _with_kvstore(redis_url: str, argv: list[str], body: Callable[[str], Awaitable[Any]]) -> Any:
    """Run a kvstore (`serve()` here) on a free port with `argv`, then `body(address)`."""
    port = free_port()
    parser = argparse.ArgumentParser()
    kvstore_server.add_arguments(parser)
    config = kvstore_server.config_from_args(
        parser.parse_args(
            [
                *("--port", str(port), "--redis-url", redis_url),
                *("--deployment", f"tls-{uuid.uuid4().hex[:8]}", "--heartbeat-s", "0.2"),
                *argv,
            ]
        )
    )

    async def main() -> Any:
        ready = asyncio.Event()
        task = asyncio.ensure_future(kvstore_server.serve(config, ready))
        try:
            await asyncio.wait_for(ready.wait(), 20)
            return await body(f"127.0.0.1:{port}")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    return asyncio.run(asyncio.wait_for(main(), 60))


async def _health(ch: grpc.aio.Channel) -> grpc.StatusCode:
    """The status of one health check over `ch` (OK when it answered)."""
    try:
        async with ch:
            await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=KVSTORE), timeout=5
            )
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _tls_args(pki: Pki) -> list[str]:
    server_cert, server_key = pki.server
    return ["--tls-cert", str(server_cert), "--tls-key", str(server_key), "--tls-ca", str(pki.ca)]


def test_mtls_refuses_clients_without_a_certificate_of_the_mesh(pki: Pki, tmp_path: Path) -> None:
    """A kvstore with mTLS and a mesh token: only the mesh's certificates get a TLS session, and
    over it the token is still checked (health needs none)."""
    token = secrets.token_hex(8)
    (tmp_path / "token").write_text(token)

    async def agent(address: str, auth: MeshAuth) -> tuple[grpc.StatusCode, bytes]:
        async with channel(address, auth) as ch:
            try:
                reply = await kvstore_pb2_grpc.KVStoreStub(ch).GetAgent(
                    kvstore_pb2.GetAgentRequest(agent_name="agent-tls"), timeout=5
                )
            except grpc.aio.AioRpcError as e:
                return e.code(), b""
        return grpc.StatusCode.OK, reply.metadata

    async def body(address: str) -> dict[str, Any]:
        ca = pki.ca.read_bytes()
        results: dict[str, Any] = {
            "plaintext": await _health(grpc.aio.insecure_channel(address)),
            "no certificate": await _health(
                grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca))
            ),
            "another CA": await _health(channel(address, pki.auth(pki.stranger, token))),
            "mesh certificate": await _health(channel(address, pki.auth(pki.client))),
        }
        client = KVStoreClient(address, auth=pki.auth(pki.client, token))
        try:
            await client.register_agent("agent-tls", b"metadata", "worker-tls")
        finally:
            await client.close()
        results["with token"] = await agent(address, pki.auth(pki.client, token))
        results["without token"] = await agent(address, pki.auth(pki.client))
        return results

    with EmbeddedRedis() as redis:
        argv = [*_tls_args(pki), "--mesh-token-file", str(tmp_path / "token")]
        results = _with_kvstore(redis.url, argv, body)
    assert results["plaintext"] == grpc.StatusCode.UNAVAILABLE
    assert results["no certificate"] == grpc.StatusCode.UNAVAILABLE
    assert results["another CA"] == grpc.StatusCode.UNAVAILABLE
    assert results["mesh certificate"] == grpc.StatusCode.OK
    assert results["with token"] == (grpc.StatusCode.OK, b"metadata")
    assert results["without token"] == (grpc.StatusCode.UNAUTHENTICATED, b"")


def test_the_health_probe_speaks_mtls(pki: Pki) -> None:
    files = (str(pki.client[0]), str(pki.client[1]), str(pki.ca))

    async def body(address: str) -> tuple[bool, bool]:
        with_files = await asyncio.to_thread(check, address, KVSTORE, 5.0, files)
        without = await asyncio.to_thread(check, address, KVSTORE, 5.0)
        return with_files.is_serving, without.is_serving

    with EmbeddedRedis() as redis:
        assert _with_kvstore(redis.url, _tls_args(pki), body) == (True, False)


# ----- secrets in logs ------------------------------------------------------------------------


def _serving(address: str, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check(address, KVSTORE, 2.0).is_serving:
        assert process.poll() is None, f"the kvstore exited {process.returncode}"
        assert time.monotonic() < deadline, "the kvstore did not serve in time"
        time.sleep(0.1)


def test_a_service_logs_neither_the_mesh_token_nor_the_redis_password() -> None:
    """A kvstore process on Redis as an ACL user with a password, its token in the environment,
    logging at DEBUG: the log shows the URL masked and no secret."""
    password, token = f"pw-{secrets.token_hex(8)}", f"tok-{secrets.token_hex(8)}"
    port = free_port()
    address = f"127.0.0.1:{port}"
    with EmbeddedRedis() as server:
        admin = redis_sync.Redis.from_url(server.url)
        admin.acl_setuser(
            "pdmesh",
            enabled=True,
            passwords=[f"+{password}"],
            keys=["*"],
            channels=["*"],
            commands=["+@all"],
        )
        url = f"redis://pdmesh:{password}@{server.host}:{server.port}/0"
        env = {**os.environ, "PDMESH_MESH_TOKEN": token, "PDMESH_REDIS_URL": url}
        argv = ["--port", str(port), "--deployment", "secrets", "--log-level", "DEBUG"]
        process = subprocess.Popen(
            [sys.executable, "-m", "pdmesh_kvstore", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            _serving(address, process)  # registered in Redis: the password worked
            users = {client["user"] for client in admin.client_list()}
            assert "pdmesh" in users, users
            with grpc.insecure_channel(address) as ch:
                stub = kvstore_pb2_grpc.KVStoreStub(ch)
                request = kvstore_pb2.GetAgentRequest(agent_name="nobody")
                for metadata, code in (
                    ((), grpc.StatusCode.UNAUTHENTICATED),
                    (((MESH_TOKEN_METADATA, token),), grpc.StatusCode.NOT_FOUND),
                ):
                    with pytest.raises(grpc.RpcError) as answer:
                        stub.GetAgent(request, metadata=metadata, timeout=10)
                    assert answer.value.code() == code
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=30)
            admin.close()
    log = output.decode(errors="replace")
    assert f"redis://***@{server.host}:{server.port}/0" in log, log
    assert '"mesh_token": true' in log, log
    assert password not in log and token not in log
