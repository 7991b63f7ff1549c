"""gRPC `pdmesh.gateway.v1.Generate` (the SDK's API) over the orchestrator.

Domain errors raised here are mapped to status codes by the server's ErrorInterceptor; a client
that cancels its call cancels the handler, which closes the event stream (aborting upstream work).
"""
from __future__ import annotations

import contextlib
from typing import Any

import grpc

from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_service.errors import MeshError
from pdmesh_gateway.core import (Completion, GenerationEvent, GenerationRequest, ModelInfo, Usage,
                                          build_request, invalid, new_request_id)
from pdmesh_gateway.orchestrator import Orchestrator
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.gateway.v1 import gateway_pb2, gateway_pb2_grpc

SERVICE_NAME = "pdmesh.gateway.v1.Generate"
_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT}
_OPTIONAL = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos", "min_tokens",
             "logprobs", "include_stop_str_in_output")


def sampling_values(proto: common_pb2.SamplingParams) -> dict[str, Any]:
    """The fields the caller set (unset ones take the defaults)."""
    values = {name: getattr(proto, name) for name in _OPTIONAL if proto.HasField(name)}
    values["stop"], values["stop_token_ids"] = list(proto.stop), list(proto.stop_token_ids)
    return values


def to_request(msg: gateway_pb2.GenerateRequest, tokenizer: Tokenizer, model: ModelInfo) -> GenerationRequest:
    name = model.resolve(msg.model)
    kind = msg.WhichOneof("prompt")
    if kind == "text":
        if not msg.text:
            raise invalid("prompt", "prompt must not be empty")
        ids = tokenizer.encode(msg.text)
    elif kind == "token_ids":
        ids = list(msg.token_ids.ids)
    else:
        raise invalid("prompt", "prompt is required (text or token_ids)")
    # The caller's id is kept as a prefix: ids must be unique across the mesh, callers' need not be.
    request_id = new_request_id(msg.request_id or "gen")
    return build_request(request_id, ids, sampling_values(msg.sampling), model, name, default_max_tokens=16)


def _logprobs(event_logprobs: Any) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                    top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for lp in event_logprobs]


def _usage(usage: Usage | None) -> common_pb2.Usage | None:
    if usage is None:
        return None
    return common_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                            cached_tokens=usage.cached_tokens)


def _stop_reason(value: str | int | None) -> str:
    return "" if value is None else str(value)


def to_chunk(request_id: str, event: GenerationEvent) -> gateway_pb2.GenerateChunk:
    return gateway_pb2.GenerateChunk(
        request_id=request_id, token_ids=list(event.token_ids), text=event.text, logprobs=_logprobs(event.logprobs),
        finish_reason=_FINISH.get(event.finish_reason or "", common_pb2.FINISH_REASON_UNSPECIFIED),
        stop_reason=_stop_reason(event.stop_reason), usage=_usage(event.usage))


def to_response(request_id: str, result: Completion) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        request_id=request_id, token_ids=result.token_ids, text=result.text, logprobs=_logprobs(result.logprobs),
        finish_reason=_FINISH.get(result.finish_reason or "", common_pb2.FINISH_REASON_UNSPECIFIED),
        stop_reason=_stop_reason(result.stop_reason), usage=_usage(result.usage))


class GenerateServicer(gateway_pb2_grpc.GenerateServicer):
    def __init__(self, orchestrator: Orchestrator, tokenizer: Tokenizer, model: ModelInfo) -> None:
        self.orchestrator, self.tokenizer, self.model = orchestrator, tokenizer, model

    def _request(self, msg: gateway_pb2.GenerateRequest) -> GenerationRequest:
        try:
            return to_request(msg, self.tokenizer, self.model)
        except MeshError as e:
            self.orchestrator.metrics.rejected(e)
            raise

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.GenerateResponse:
        req = self._request(request)
        result = Completion()
        async with contextlib.aclosing(self.orchestrator.generate(req)) as events:
            async for event in events:
                result.add(event)
        return to_response(request.request_id or req.request_id, result)

    async def GenerateStream(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        req = self._request(request)
        async with contextlib.aclosing(self.orchestrator.generate(req)) as events:
            async for event in events:
                yield to_chunk(request.request_id or req.request_id, event)

    async def ListModels(self, request: gateway_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        return gateway_pb2.ListModelsResponse(models=[self.model.name])


def add_to_server(servicer: GenerateServicer, server: grpc.aio.Server) -> None:
    gateway_pb2_grpc.add_GenerateServicer_to_server(servicer, server)
