"""An asyncio gRPC server with the standard health service and one error interceptor, and the
mesh's client channels; both secured by the process's `MeshAuth`.

Servicers raise domain errors (`pdmesh_service.errors`) or ValueError; the interceptor turns
them into status codes and binds the caller's request id (gRPC metadata `x-request-id`) to the logs.

Mesh security (internal RPCs only; the gateway's front doors take an API key instead):
- `MeshAuth` is built once per service from its `CommonConfig` (`MeshAuth.from_config`, in the
  service's `serve`) and handed to the two places that use it: `start_grpc_server(auth=...)` and
  `channel(address, auth)` (the kvstore client, the gateway's worker client). Passing it, rather
  than keeping it in a module global, lets one process (a test) run services with different
  settings side by side, and leaves no hidden state; a channel made without it carries nothing.
- Mesh token: the server refuses every RPC with UNAUTHENTICATED unless its metadata
  `x-pdmesh-mesh-token` equals the token (`hmac.compare_digest`), except the standard health and
  reflection services (probes hold no secret). The refusal comes before the error interceptor, the
  request is not even parsed. A channel adds the metadata to every call (client interceptors:
  they work on insecure channels, where call credentials would need TLS).
- mTLS: with a certificate, key and CA the server asks every client for a certificate signed by
  the CA (health checks too: the handshake comes before any RPC) and channels present theirs.

Health names: "" and the service's own names are SERVING from `set_serving()` until `stop()`; the
names `liveness` and `readiness` follow the process's probes (`pdmesh_service.probes`).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdmesh_service.errors import MeshError
from pdmesh_service.logging import bind_request_id, get_logger
from pdmesh_service.probes import Probes, process_probes

if TYPE_CHECKING:
    from pdmesh_service.options import CommonConfig

log = get_logger(__name__)
REQUEST_ID_METADATA = "x-request-id"
# decode.Decode's initial metadata: the request is in the batch
ADMITTED_METADATA = "x-pdmesh-admitted"
MESH_TOKEN_METADATA = "x-pdmesh-mesh-token"
# Methods open without credentials: the standard health service and server reflection.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a peer that restarts is reconnected within a second or two (gRPC's default backoff grows to
    # two minutes: a restarted worker would get no traffic for that long)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
# The metadata of a call as interceptors see it: (key, value) pairs.
Metadata = Sequence[tuple[str, str | bytes]]

# A servicer method as grpc.aio calls it: (request message, context).
UnaryMethod = Callable[[object, grpc.aio.ServicerContext], Awaitable[object]]
StreamMethod = Callable[[object, grpc.aio.ServicerContext], AsyncIterator[object]]


def status_of(error: BaseException) -> grpc.StatusCode | None:
    """The status a servicer's error maps to: a domain error's own, INVALID_ARGUMENT for a
    ValueError, UNAVAILABLE for Redis being unreachable or busy loading (a peer that comes back: the
    caller retries), None (INTERNAL) for the rest."""
    if isinstance(error, MeshError):
        return grpc.StatusCode[error.grpc_code]
    if isinstance(error, (RedisConnectionError, RedisTimeoutError, BusyLoadingError)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return None


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_METADATA:
            return str(value)  # ascii metadata (the key has no -bin suffix): already a str
    return ""


# grpc ships no type stubs, so its ServerInterceptor base is Any to mypy.
class ErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Maps domain errors to status codes; binds the request id for the handler's logs."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health"):
            return handler
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, details.method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, details.method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    @staticmethod
    def _wrap_unary(inner: UnaryMethod, method: str) -> UnaryMethod:
        async def call(request: object, context: grpc.aio.ServicerContext) -> object:
            bind_request_id(_request_id(context))
            try:
                return await inner(request, context)
            except Exception as e:  # noqa: BLE001 - mapped or re-raised below
                await _abort(context, e, method)

        return call

    @staticmethod
    def _wrap_stream(inner: StreamMethod, method: str) -> StreamMethod:
        async def call(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
            bind_request_id(_request_id(context))
            try:
                async for item in inner(request, context):
                    yield item
            except Exception as e:  # noqa: BLE001 - mapped or re-raised below
                await _abort(context, e, method)

        return call


async def _abort(context: grpc.aio.ServicerContext, error: Exception, method: str) -> NoReturn:
    """Raise: `error` itself when it is an abort already, else the status it maps to (INTERNAL,
    logged, for an unmapped error). `context.abort` always raises grpc.aio.AbortError."""
    code = status_of(error)
    if code is None:
        if isinstance(error, grpc.aio.AbortError):
            raise error
        log.exception("unhandled error", method=method)
        await context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
    await context.abort(code, str(error))
    raise RuntimeError("context.abort returned")  # unreachable: abort raises AbortError


@dataclass(frozen=True)
class MeshAuth:
    """What this process's internal gRPC requires and presents (module docstring): the mesh token
    ("": none) and the PEM contents of its certificate, key and CA (empty: no TLS)."""

    token: str = field(default="", repr=False)
    tls_cert: bytes = field(default=b"", repr=False)
    tls_key: bytes = field(default=b"", repr=False)
    tls_ca: bytes = field(default=b"", repr=False)

    @classmethod
    def from_config(cls, common: CommonConfig) -> MeshAuth:
        """The service's settings, its PEM files read now (OSError if one went away)."""
        if not common.has_tls:
            return cls(common.mesh_token)
        return cls(
            common.mesh_token,
            Path(common.tls_cert).read_bytes(),
            Path(common.tls_key).read_bytes(),
            Path(common.tls_ca).read_bytes(),
        )

    @property
    def has_tls(self) -> bool:
        return bool(self.tls_cert)

    def __repr__(self) -> str:
        return f"MeshAuth(token={bool(self.token)}, tls={self.has_tls})"

    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS that requires a client certificate signed by the CA."""
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)], root_certificates=self.tls_ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS that trusts the CA and presents this process's certificate."""
        return grpc.ssl_channel_credentials(self.tls_ca, self.tls_key, self.tls_cert)


NO_AUTH = MeshAuth()


def metadata_value(metadata: Metadata | None, key: str) -> str | None:
    """The first value of `key` in `metadata` (None: absent), as text."""
    for k, v in metadata or ():
        if k == key:
            return v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    return None


def secret_matches(given: str | None, secret: str) -> bool:
    """Whether `given` is `secret`, in time independent of where they differ."""
    return given is not None and hmac.compare_digest(given.encode(), secret.encode())


# What an AuthInterceptor asks of a call's metadata: None to let it through, else why it is refused.
Refusal = Callable[[Metadata | None], str | None]


def mesh_token_refusal(token: str) -> Refusal:
    def refusal(metadata: Metadata | None) -> str | None:
        given = metadata_value(metadata, MESH_TOKEN_METADATA)
        if secret_matches(given, token):
            return None
        return "missing mesh token" if given is None else "wrong mesh token"

    return refusal


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses with UNAUTHENTICATED every call whose metadata `refusal` finds wanting, except the
    open methods (health, reflection); a refused call's request is not parsed."""

    def __init__(self, refusal: Refusal, open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES):
        self.refusal, self.open_prefixes = refusal, open_prefixes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        reason = None
        if not details.method.startswith(self.open_prefixes):
            reason = self.refusal(details.invocation_metadata)
        handler = await continuation(details)
        if reason is None or handler is None:
            return handler
        return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, reason)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, reason: str) -> Any:
    """A handler of `handler`'s kind that aborts with (code, reason) before reading anything."""

    async def refuse(_request: object, context: grpc.aio.ServicerContext) -> NoReturn:
        await context.abort(code, reason)
        raise RuntimeError("context.abort returned")  # unreachable: abort raises AbortError

    async def refuse_stream(
        _request: object, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[object]:
        await context.abort(code, reason)
        yield None  # unreachable: makes this an async generator, as streaming handlers are

    kinds = (
        (handler.unary_unary, grpc.unary_unary_rpc_method_handler, refuse),
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler, refuse_stream),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler, refuse),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler, refuse_stream),
    )
    for behavior, make, behavior_of_refusal in kinds:
        if behavior is not None:
            return make(behavior_of_refusal, response_serializer=handler.response_serializer)
    return handler


@dataclass
class GrpcServer:
    server: grpc.aio.Server
    health: health_async.HealthServicer
    port: int
    service_names: tuple[str, ...]
    probes: Probes = field(default_factory=process_probes)
    # the probes' updater when this server started it (no process runner did)
    probe_task: asyncio.Task[None] | None = None

    async def set_serving(self, serving: bool = True) -> None:
        """The service's names SERVING or not; serving also means started, for readiness."""
        if serving:
            self.probes.started = True
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float = 2.0) -> None:
        """Stop serving: draining (live, not ready) while in-flight calls get `grace` seconds."""
        self.probes.draining = True
        await self.probes.update()
        await self.set_serving(False)
        await self.server.stop(grace)
        self.probes.detach(self.health)
        if self.probe_task is not None:
            self.probe_task.cancel()
            await asyncio.gather(self.probe_task, return_exceptions=True)


async def start_grpc_server(
    host: str,
    port: int,
    register: Iterable[Callable[[grpc.aio.Server], None]],
    service_names: Iterable[str],
    *,
    auth: MeshAuth = NO_AUTH,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    probes: Probes | None = None,
) -> GrpcServer:
    """Start serving (health NOT_SERVING until `set_serving()`); port 0 picks a free port.
    `probes`: what `liveness` and `readiness` answer (default: the process's, `process_probes`).

    `auth`: the mesh token every call must carry and the mTLS credentials (module docstring);
    `interceptors` run first, before the token check (the gateway's API key: its front door takes
    no mesh token and no client certificate, so it passes no `auth`)."""
    checks = [AuthInterceptor(mesh_token_refusal(auth.token))] if auth.token else []
    server = grpc.aio.server(
        interceptors=[*interceptors, *checks, ErrorInterceptor()],
        options=[
            *CHANNEL_OPTIONS,
            # gRPC sets SO_REUSEPORT by default, so a second server on a port in use would start
            # and split the traffic; a port in use must be an error at start instead.
            ("grpc.so_reuseport", 0),
        ],
    )
    for add in register:
        add(server)
    health = health_async.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"{host}:{port}"
    try:
        if auth.has_tls:
            bound = server.add_secure_port(address, auth.server_credentials())
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # grpc.aio's answer to a failed bind
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind gRPC on {host}:{port} (is the port in use?)")
    await server.start()
    probes = process_probes() if probes is None else probes
    result = GrpcServer(server, health, bound, tuple(service_names), probes, probes.start())
    await result.set_serving(False)
    await probes.attach(health)
    return result


def channel(address: str, auth: MeshAuth = NO_AUTH) -> grpc.aio.Channel:
    """A client channel with the mesh's message limits; with `auth`, every call carries the mesh
    token and the channel speaks TLS with this process's certificate (module docstring)."""
    interceptors = _metadata_interceptors(MESH_TOKEN_METADATA, auth.token) if auth.token else None
    if auth.has_tls:
        return grpc.aio.secure_channel(
            address, auth.channel_credentials(), options=CHANNEL_OPTIONS, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)


def _with_metadata(
    details: grpc.aio.ClientCallDetails, entry: tuple[str, str]
) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(*entry)
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _AddsMetadata:
    """Adds one metadata entry to every call (one subclass per call kind: a grpc.aio channel files
    an interceptor under the first kind it is an instance of)."""

    def __init__(self, key: str, value: str) -> None:
        self.entry = (key, value)

    async def _call(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(_with_metadata(details, self.entry), request)


class _UnaryUnaryMetadata(_AddsMetadata, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._call(continuation, details, request)


class _UnaryStreamMetadata(_AddsMetadata, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self._call(continuation, details, request)


class _StreamUnaryMetadata(_AddsMetadata, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self._call(continuation, details, requests)


class _StreamStreamMetadata(_AddsMetadata, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self._call(continuation, details, requests)


def _metadata_interceptors(key: str, value: str) -> list[grpc.aio.ClientInterceptor]:
    kinds = (_UnaryUnaryMetadata, _UnaryStreamMetadata, _StreamUnaryMetadata, _StreamStreamMetadata)
    return [kind(key, value) for kind in kinds]


def request_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_METADATA, request_id),)
