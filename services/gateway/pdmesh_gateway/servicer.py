"""gRPC `pdmesh.gateway.v1.Generate` (the SDK's API) over the orchestrator.

Domain errors raised here are mapped to status codes by the server's ErrorInterceptor; a client
that cancels its call cancels the handler, which closes the event stream (aborting upstream work).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import grpc

from pdmesh_engine.grammar import check_grammar
from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_gateway.core import (
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    ModelInfo,
    TokenLogprob,
    Usage,
    build_request,
    invalid,
    new_request_id,
)
from pdmesh_gateway.orchestrator import Orchestrator
from pdmesh_gateway.tenant_admission import tenancy_of
from pdmesh_gateway.tenants import PRIORITY_HEADER
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pdmesh_service.convert import finish_reason_to_pb, sampling_values_from_pb, token_logprob_pb
from pdmesh_service.errors import MeshError
from pdmesh_service.grpc_server import metadata_value

SERVICE_NAME = "pdmesh.gateway.v1.Generate"


def to_request(
    message: gateway_pb2.GenerateRequest, tokenizer: Tokenizer, model: ModelInfo
) -> GenerationRequest:
    name = model.resolve(message.model)
    kind = message.WhichOneof("prompt")
    if kind == "text":
        if not message.text:
            raise invalid("prompt", "prompt must not be empty")
        ids = tokenizer.encode(message.text)
    elif kind == "token_ids":
        ids = list(message.token_ids.ids)
    else:
        raise invalid("prompt", "prompt is required (text or token_ids)")
    # The caller's id is kept as a prefix: ids must be unique across the mesh, callers' need not be.
    request_id = new_request_id(message.request_id or "gen")
    # unset fields take the defaults
    values: dict[str, Any] = sampling_values_from_pb(message.sampling)
    request = build_request(request_id, ids, values, model, name, default_max_tokens=16)
    if request.params.grammar_kind is not None:  # a grammar that does not compile: 400 here
        try:
            check_grammar(request.params.grammar_kind, request.params.grammar)
        except ValueError as e:
            raise invalid("grammar", str(e)) from None
    return request


def _logprobs(logprobs: Sequence[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [token_logprob_pb(lp.token_id, lp.logprob, lp.top) for lp in logprobs]


def _usage(usage: Usage | None) -> common_pb2.Usage | None:
    if usage is None:
        return None
    return common_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
    )


def _stop_reason(value: str | int | None) -> str:
    return "" if value is None else str(value)


def to_chunk(request_id: str, event: GenerationEvent) -> gateway_pb2.GenerateChunk:
    return gateway_pb2.GenerateChunk(
        request_id=request_id,
        token_ids=list(event.token_ids),
        text=event.text,
        logprobs=_logprobs(event.logprobs),
        finish_reason=finish_reason_to_pb(event.finish_reason),
        stop_reason=_stop_reason(event.stop_reason),
        usage=_usage(event.usage),
    )


def to_response(request_id: str, result: GenerationResult) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=result.token_ids,
        text=result.text,
        logprobs=_logprobs(result.logprobs),
        finish_reason=finish_reason_to_pb(result.finish_reason),
        stop_reason=_stop_reason(result.stop_reason),
        usage=_usage(result.usage),
    )


class GenerateServicer(gateway_pb2_grpc.GenerateServicer):
    def __init__(self, orchestrator: Orchestrator, tokenizer: Tokenizer, model: ModelInfo) -> None:
        self.orchestrator, self.tokenizer, self.model = orchestrator, tokenizer, model

    def _request(
        self, message: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> GenerationRequest:
        """The request with its tenancy (the key's tenant, the x-pdmesh-priority metadata's class,
        else the sampling priority's)."""
        try:
            self.orchestrator.check_queue()  # RESOURCE_EXHAUSTED at once when the queue is full
            request = to_request(message, self.tokenizer, self.model)
            metadata = context.invocation_metadata()
            tenancy = tenancy_of(
                self.orchestrator.tenants,
                metadata_value(metadata, "authorization"),
                metadata_value(metadata, PRIORITY_HEADER),
                request.params.priority if message.sampling.HasField("priority") else None,
            )
            return replace(request, tenancy=tenancy)
        except MeshError as e:
            self.orchestrator.metrics.rejected(e)
            raise

    async def Generate(
        self, message: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GenerateResponse:
        request = self._request(message, context)
        result = GenerationResult()
        async with contextlib.aclosing(self.orchestrator.generate(request)) as events:
            async for event in events:
                result.add(event)
        return to_response(message.request_id or request.request_id, result)

    async def GenerateStream(
        self, message: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateChunk]:
        request = self._request(message, context)
        async with contextlib.aclosing(self.orchestrator.generate(request)) as events:
            async for event in events:
                yield to_chunk(message.request_id or request.request_id, event)

    async def ListModels(
        self, message: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        return gateway_pb2.ListModelsResponse(models=[self.model.name])


def add_to_server(servicer: GenerateServicer, server: grpc.aio.Server) -> None:
    gateway_pb2_grpc.add_GenerateServicer_to_server(servicer, server)
