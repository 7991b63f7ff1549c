"""An asyncio gRPC server with the standard health service and one error interceptor.

Servicers raise domain errors (`pdmesh_service.errors`) or ValueError; the interceptor turns
them into status codes and binds the caller's request id (gRPC metadata `x-request-id`) to the logs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import NoReturn

import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh_service.errors import MeshError
from pdmesh_service.logging import bind_request_id, get_logger

log = get_logger(__name__)
REQUEST_ID_METADATA = "x-request-id"
# decode.Decode's initial metadata: the request is in the batch
ADMITTED_METADATA = "x-pdmesh-admitted"
MAX_MESSAGE_BYTES = 64 << 20

# A servicer method as grpc.aio calls it: (request message, context).
UnaryMethod = Callable[[object, grpc.aio.ServicerContext], Awaitable[object]]
StreamMethod = Callable[[object, grpc.aio.ServicerContext], AsyncIterator[object]]


def status_of(error: BaseException) -> grpc.StatusCode | None:
    if isinstance(error, MeshError):
        return grpc.StatusCode[error.grpc_code]
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


@dataclass
class GrpcServer:
    server: grpc.aio.Server
    health: health_async.HealthServicer
    port: int
    service_names: tuple[str, ...]

    async def set_serving(self, serving: bool = True) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float = 2.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


async def start_grpc_server(
    host: str,
    port: int,
    register: Iterable[Callable[[grpc.aio.Server], None]],
    service_names: Iterable[str],
) -> GrpcServer:
    """Start serving (health NOT_SERVING until `set_serving()`); port 0 picks a free port."""
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor()],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # gRPC sets SO_REUSEPORT by default, so a second server on a port in use would start
            # and split the traffic; a port in use must be an error at start instead.
            ("grpc.so_reuseport", 0),
        ],
    )
    for add in register:
        add(server)
    health = health_async.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc.aio's answer to a failed bind
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind gRPC on {host}:{port} (is the port in use?)")
    await server.start()
    result = GrpcServer(server, health, bound, tuple(service_names))
    await result.set_serving(False)
    return result


def channel(address: str) -> grpc.aio.Channel:
    """A client channel with the mesh's message limits."""
    return grpc.aio.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ],
    )


def request_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_METADATA, request_id),)
