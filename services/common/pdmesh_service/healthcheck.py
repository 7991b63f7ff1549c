"""`python -m pdmesh_service.healthcheck --address HOST:PORT --service NAME [--timeout 3]`, or
`python -m pdmesh_service.healthcheck --url http://HOST:PORT/health/ready [--timeout 3]`.

One gRPC health check: exit status 0 when the standard health service (grpc.health.v1.Health/Check)
answers SERVING for NAME (e.g. `pdmesh.kvstore.v1.KVStore`; "" asks about the server as a whole),
else 1 with one line on stderr saying why (NOT_SERVING, unknown service, unreachable, timed out).
Argument errors exit 2. What container HEALTHCHECKs and Kubernetes exec probes run: one channel,
no more imported than grpc and the health stubs, so a probe stays cheap. A service with mTLS asks
every client for a certificate, probes too: `--tls-cert/--tls-key/--tls-ca` (defaults: the
service's own PDMESH_TLS_CERT, PDMESH_TLS_KEY, PDMESH_TLS_CA) make the check over TLS.

`--url`: one HTTP GET instead (the probes on a service's metrics port or the gateway's REST port:
/health/live, /health/ready; `pdmesh_service.probes`): healthy on status 200, else the status and
the body's reason on stderr. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class HealthResult:
    is_serving: bool
    reason: str  # one line: the status, or why there is none


def _channel(address: str, tls: tuple[str, str, str] | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    cert, key, ca = (Path(path).read_bytes() for path in tls)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert))


def check(
    address: str, service: str, timeout_s: float, tls: tuple[str, str, str] | None = None
) -> HealthResult:
    """Ask `address` once, giving up after `timeout_s` (connecting included); `tls`: the PEM files
    (certificate, key, CA) of an mTLS check."""
    if timeout_s <= 0:
        raise ValueError(f"timeout must be positive, got {timeout_s}")
    where = f"{address} {service!r}"
    with _channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            reply = stub.Check(request, timeout=timeout_s)
        except grpc.RpcError as e:
            if not isinstance(e, grpc.Call):
                return HealthResult(False, f"{where}: {type(e).__name__}")
            lines = (e.details() or "").splitlines()
            detail = lines[0] if lines else ""
            return HealthResult(False, f"{where}: {e.code().name} {detail}".rstrip())
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return HealthResult(reply.status == SERVING, f"{where}: {status}")


def check_url(url: str, timeout_s: float) -> HealthResult:
    """GET `url` once: healthy on HTTP 200."""
    import json
    import urllib.error
    import urllib.request

    if timeout_s <= 0:
        raise ValueError(f"timeout must be positive, got {timeout_s}")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must be an http:// URL, got {url!r}")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - checked
            status, body = response.status, response.read(4096)
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read(4096)
    except (urllib.error.URLError, OSError) as e:
        return HealthResult(False, f"{url}: {getattr(e, 'reason', e)}")
    try:
        reason = str(json.loads(body).get("reason", ""))
    except (ValueError, AttributeError):
        reason = ""
    return HealthResult(status == 200, f"{url}: HTTP {status} {reason}".rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdmesh_service.healthcheck",
        description="exit 0 when a gRPC health check answers SERVING, else 1",
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--address", help="HOST:PORT of the gRPC server")
    target.add_argument(
        "--url", help="an HTTP probe instead, e.g. http://127.0.0.1:9090/health/ready"
    )
    parser.add_argument(
        "--service", default="", help="health service name, e.g. pdmesh.kvstore.v1.KVStore"
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--quiet", action="store_true", help="print nothing when SERVING")
    for flag in ("--tls-cert", "--tls-key", "--tls-ca"):
        env = "PDMESH_" + flag.removeprefix("--").replace("-", "_").upper()
        parser.add_argument(flag, metavar="PEM", default=os.environ.get(env, ""), help=f"${env}")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    files = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(files) and not all(files):
        parser.error("mTLS takes --tls-cert, --tls-key and --tls-ca together")
    if args.url is not None:
        try:
            result = check_url(args.url, args.timeout)
        except ValueError as e:
            parser.error(str(e))
    else:
        try:
            result = check(args.address, args.service, args.timeout, files if all(files) else None)
        except OSError as e:
            print(f"unhealthy: cannot read the TLS files: {e}", file=sys.stderr)
            return 1
    if not result.is_serving:
        print(f"unhealthy: {result.reason}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"healthy: {result.reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
