"""The OpenAI-compatible REST API (Starlette): route handlers over `openai_api` and the
orchestrator.

Domain errors become OpenAI error objects here (one place). Streams are SSE `data: {...}` chunks
ending with `data: [DONE]`; an error after the first chunk is sent as a `data: {"error": ...}`
chunk. A client that disconnects cancels the upstream work, streaming or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import asdict, replace
from typing import Any, TypeVar

import redis.asyncio as aioredis
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_gateway.admission import PrefillAdmission, Shed
from pdmesh_gateway.auth import ApiKeyMiddleware
from pdmesh_gateway.core import GenerationEvent, GenerationResult, ModelInfo
from pdmesh_gateway.openai_api import (
    OpenAIRequest,
    Shaper,
    error_body,
    models_response,
    parse_chat,
    parse_completion,
)
from pdmesh_gateway.openapi import build_openapi
from pdmesh_gateway.orchestrator import Mode, Orchestrator
from pdmesh_gateway.router import Router, health
from pdmesh_gateway.start import Starter
from pdmesh_gateway.tenant_admission import tenancy_of
from pdmesh_gateway.tenants import PRIORITY_HEADER, body_priority
from pdmesh_service.eplb_protocol import summarize_all
from pdmesh_service.errors import InvalidArgument, MeshError, PayloadTooLarge
from pdmesh_service.instance import InstanceInfo, Role
from pdmesh_service.logging import get_logger
from pdmesh_service.probes import LIVE_PATH, READY_PATH, Probes, Verdict, liveness, readiness
from pdmesh_service.supervision import read_restarts

log = get_logger(__name__)
T = TypeVar("T")
_HTTP_ERROR_TYPES = {
    404: "not_found_error",
    405: "invalid_request_error",
    400: "invalid_request_error",
}


# The rows of GET /mesh/eplb: one dict per (instance, model) (`EplbSummary.to_dict`), read from
# Redis.
EplbView = Callable[[], Awaitable[list[dict[str, Any]]]]


def eplb_view(redis: aioredis.Redis, deployment: str) -> EplbView:
    """The EPLB state of `deployment` as eplb_protocol keeps it in Redis."""

    async def rows() -> list[dict[str, Any]]:
        return [s.to_dict() for s in await summarize_all(redis, deployment, default_enabled=None)]

    return rows


RestartsView = Callable[[], Awaitable[dict[str, dict[str, Any]]]]


def restarts_view(redis: aioredis.Redis, deployment: str) -> RestartsView:
    """The restarts of `deployment`'s services, as their supervisor (`pdmesh up`) records them."""

    async def records() -> dict[str, dict[str, Any]]:
        return await read_restarts(redis, deployment)

    return records


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


DP_RANK_HEADER = "x-data-parallel-rank"


def _dp_rank(request: Request) -> int | None:
    """The X-Data-Parallel-Rank header (as vLLM's): the DP rank of the ranks that compute the
    prompt; absent: None."""
    raw = request.headers.get(DP_RANK_HEADER)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidArgument(f"X-Data-Parallel-Rank must be an integer >= 0, got {raw!r}")
    return value


def routing_view(starter: Starter) -> dict[str, Any]:
    handoffs = starter.handoffs
    return {
        "prefill": str(starter.routing.prefill),
        "decode_balance": str(starter.routing.decode_balance),
        "local_prefill": str(starter.routing.local_prefill),
        "local_prefill_threshold_tokens": starter.local_threshold,
        "handoff_overhead_ms": round(handoffs.overhead_s * 1e3, 3),
        "prefill_tokens_per_s": round(handoffs.tokens_per_s, 1),
        "handoffs_measured": handoffs.samples,
        # what a hand-off moves over NIXL (V4's hybrid state is a fraction of V3's latents)
        "kv_bytes_per_handoff": handoffs.kv_bytes_per_handoff,
        "kv_bytes_per_prompt_token": None
        if (per_token := handoffs.kv_bytes_per_prompt_token) is None
        else round(per_token, 1),
        "prefill_paths": dict(starter.paths),
    }


def queue_view(admission: PrefillAdmission) -> dict[str, Any]:
    wait = admission.estimated_wait_s()
    return {
        "queued": admission.waiting,
        "max_queued": admission.max_queued,
        "max_queue_wait_s": admission.limits.max_wait_s,
        "estimated_wait_s": None if wait is None else round(wait, 3),
        "shed": dict(admission.num_shed),
    }


def metrics_url(info: InstanceInfo) -> str | None:
    """Where an instance rank's Prometheus metrics are: its metrics port (a gateway without one:
    its REST port) on the host of its gRPC address; None when it serves none."""
    port = info.metrics_port or (info.http_port if info.role == Role.GATEWAY else 0)
    if not port:
        return None
    host = info.address.rsplit(":", 1)[0]
    return f"http://{host}:{port}/metrics"


def mesh_problem(router: Router) -> str | None:
    """Why the gateway should take no traffic, as its registry view says (None: it can serve): the
    registry unreachable, or no decode rank ready (decode ranks serve in agg mode too)."""
    if router.refresh_error is not None:
        return f"the registry is unreachable ({router.refresh_error})"
    if not router.has_ready(Role.DECODE):
        return "no decode rank is ready"
    return None


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_response(error: MeshError) -> JSONResponse:
    """The OpenAI error shape; a shed request's answer says when to retry (`Retry-After`)."""
    headers = {"Retry-After": error.retry_after_header} if isinstance(error, Shed) else None
    return JSONResponse(error_body(error), status_code=error.http_status, headers=headers)


DEFAULT_MAX_BODY_BYTES = 16 << 20  # a request body over this is refused with 413


async def _read_json(request: Request, max_bytes: int) -> Any:
    """The JSON body: 413 past `max_bytes` (read no further), 400 for bad JSON, nesting too deep
    for the parser, or text that is not valid Unicode (a lone surrogate from a `\\udXXX` escape)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"the request body is {declared} bytes; the limit is {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"the request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except ValueError as e:  # bad JSON or UTF-8, an integer past the digit limit of int()
        raise InvalidArgument(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidArgument("the request body is nested too deeply") from None
    _check_text(body)
    return body


def _check_text(body: Any) -> None:
    """InvalidArgument if a string anywhere in `body` cannot be UTF-8 (iterative: any depth)."""
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidArgument(
                    "the request holds a string that is not valid Unicode (a lone surrogate)"
                ) from None
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


class _EventStream(StreamingResponse):
    """A StreamingResponse that always closes its body iterator (so upstream work is cancelled)."""

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI signature
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


async def _stream_body(
    shaper: Shaper, first: GenerationEvent, events: AsyncGenerator[GenerationEvent, None]
) -> AsyncIterator[str]:
    try:
        event = first
        while True:
            for chunk in shaper.chunks(event):
                yield _sse(chunk)
            if event.finish_reason is not None:
                break
            event = await events.__anext__()
        if shaper.api_request.include_usage:
            yield _sse(shaper.usage_chunk(event.usage))
    except MeshError as e:
        yield _sse(error_body(e))
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"


async def _collect(events: AsyncGenerator[GenerationEvent, None]) -> GenerationResult:
    result = GenerationResult()
    async with contextlib.aclosing(events):
        async for event in events:
            result.add(event)
    return result


class _Handlers:
    """Route handlers: each a few lines over openai_api and the orchestrator."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        tokenizer: Tokenizer,
        model: ModelInfo,
        registry: CollectorRegistry,
        eplb: EplbView | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        restarts: RestartsView | None = None,
        probes: Probes | None = None,
    ) -> None:
        # an app on its own (no process probes): started once it answers
        self.probes = probes if probes is not None else Probes(started=True)
        self.orchestrator, self.tokenizer, self.model, self.registry = (
            orchestrator,
            tokenizer,
            model,
            registry,
        )
        self.eplb, self.max_body_bytes, self.restarts = eplb, max_body_bytes, restarts

    async def _generate(
        self, request: Request, parse: Callable[[Any, Tokenizer, ModelInfo], OpenAIRequest]
    ) -> Response:
        try:
            self.orchestrator.check_queue()  # shed before reading: a refusal costs next to nothing
            body = await _read_json(request, self.max_body_bytes)
            # Tokenizing a big prompt (and the chat template) takes long: off the event loop.
            api_request = await asyncio.to_thread(parse, body, self.tokenizer, self.model)
            tenancy = tenancy_of(
                self.orchestrator.tenants,
                request.headers.get("authorization"),
                request.headers.get(PRIORITY_HEADER),
                body_priority(body),
            )
        except MeshError as e:
            self.orchestrator.metrics.rejected(e)
            raise
        pin = _dp_rank(request)
        api_request = replace(
            api_request, request=replace(api_request.request, dp_rank=pin, tenancy=tenancy)
        )
        request_id = api_request.request.request_id
        shaper = Shaper(api_request, self.tokenizer)
        events = self.orchestrator.generate(api_request.request)
        try:
            if not api_request.stream:
                return JSONResponse(
                    shaper.response(await _unless_disconnected(request, _collect(events)))
                )
            first = await _unless_disconnected(request, events.__anext__())
        except ClientGone:
            log.info("client disconnected", request_id=request_id)
            await events.aclose()
            return Response(status_code=499)
        except BaseException:
            await events.aclose()
            raise
        return _EventStream(
            _stream_body(shaper, first, events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
        )

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def models(self, _: Request) -> Response:
        return JSONResponse(models_response(self.model))

    async def health(self, _: Request) -> Response:
        """200 when requests can be served ("ok", or "degraded" with the problems listed: Redis
        unreachable, no kvstore or prefill rank), 503 when not ("unavailable": no decode rank)."""
        orchestrator = self.orchestrator
        status, checks = health(orchestrator.router, orchestrator.mode is Mode.DISAGG)
        body = {"status": status, "mode": orchestrator.mode.value, **checks}
        return JSONResponse(body, status_code=503 if status == "unavailable" else 200)

    def _verdicts(self) -> tuple[Verdict, Verdict]:
        # answered on the event loop: it turns
        inputs = replace(self.probes.inputs(), loop_silent_s=0.0)
        problem = mesh_problem(self.orchestrator.router)
        if problem is not None and problem not in inputs.problems:
            inputs = replace(inputs, problems=(*inputs.problems, problem))
        return liveness(inputs), readiness(inputs)

    async def live(self, _: Request) -> Response:
        """200 while the process serves (its event loop answers this); 503 with the reason once it
        cannot serve again."""
        verdict = self._verdicts()[0]
        return JSONResponse(verdict.body(), status_code=verdict.http_status)

    async def ready(self, _: Request) -> Response:
        """200 when this gateway should get traffic: started, not draining, the registry readable
        and a decode rank ready; else 503 with the reason."""
        verdict = self._verdicts()[1]
        return JSONResponse(verdict.body(), status_code=verdict.http_status)

    async def metrics(self, _: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def mesh(self, _: Request) -> Response:
        """`instances`: every registered instance rank with its role, rank, address, readiness,
        load and `metrics_url` (its Prometheus endpoint; null: none); `eplb`: what /mesh/eplb lists
        (expert placements per instance and model); `restarts`:
        per service that its supervisor restarted, how often, its last exit code and when (null
        while Redis cannot be read); `routing`: the routing settings, the local-prefill threshold in
        force, the hand-off costs measured, and requests started per prefill path; `queue`: the
        requests waiting for a prefill slot, the bounds, the estimated wait of a request arriving
        now (null until slots were granted) and the requests shed per reason; `tenants`: the fair
        queue (start slots, queued, per tenant and class admitted and rejected requests and tokens,
        mean wait)."""
        now_ms = int(time.time() * 1000)
        instances = [
            {**asdict(i), "age_ms": max(now_ms - i.updated_ms, 0), "metrics_url": metrics_url(i)}
            for i in self.orchestrator.router.snapshot()
        ]
        restarts: dict[str, dict[str, Any]] | None = {}
        if self.restarts is not None:
            try:
                restarts = await self.restarts()
            except (aioredis.RedisError, OSError):
                restarts = None
        return JSONResponse(
            {
                "instances": instances,
                "eplb": await self.eplb() if self.eplb is not None else [],
                "restarts": restarts,
                "routing": routing_view(self.orchestrator.starter),
                "queue": queue_view(self.orchestrator.admission),
                "tenants": self.orchestrator.gate.view(),
            }
        )

    async def mesh_eplb(self, _: Request) -> Response:
        """Per (instance, model): placement version, the ranks' running versions, balancedness now,
        the last rebalance (slots and bytes moved, plan ms), the Off switch (null: the controller's
        default)."""
        return JSONResponse(await self.eplb() if self.eplb is not None else [])


def _openapi(document: dict[str, Any]) -> Callable[[Request], Awaitable[Response]]:
    """The handler of GET /openapi.json: `document` (built once, at start)."""

    async def openapi(_: Request) -> Response:
        return JSONResponse(document)

    return openapi


async def _mesh_error(_: Request, error: Exception) -> Response:
    return error_response(error)


async def _http_error(_: Request, error: Exception) -> Response:
    status = getattr(error, "status_code", 500)
    body = {
        "error": {
            "message": str(getattr(error, "detail", error)),
            "param": None,
            "code": None,
            "type": _HTTP_ERROR_TYPES.get(status, "invalid_request_error"),
        }
    }
    return JSONResponse(body, status_code=status)


def create_app(
    orchestrator: Orchestrator,
    tokenizer: Tokenizer,
    model: ModelInfo,
    registry: CollectorRegistry | None = None,
    eplb: EplbView | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_key: str = "",
    restarts: RestartsView | None = None,
    probes: Probes | None = None,
) -> Starlette:
    """The gateway's HTTP app; `registry` is what /metrics exposes (default: the process registry),
    `eplb` what /mesh/eplb lists (none: an empty list), `restarts` what /mesh says of restarts
    (none: nothing restarted); bodies over `max_body_bytes` get 413; with
    `api_key`, /v1 and /mesh routes need `Authorization: Bearer <api_key>` (auth.py), else 401;
    `probes`: the process's (`pdmesh_service.probes`), which /health/live and /health/ready answer
    from and whose gRPC `readiness` then also needs `mesh_problem` to be None (none: the app's
    own)."""
    h = _Handlers(
        orchestrator,
        tokenizer,
        model,
        registry or REGISTRY,
        eplb,
        max_body_bytes,
        restarts,
        probes,
    )
    if probes is not None:
        probes.add_check(lambda: mesh_problem(orchestrator.router))
    routes = [
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/chat/completions", h.chat, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
        Route(LIVE_PATH, h.live, methods=["GET"]),
        Route(READY_PATH, h.ready, methods=["GET"]),
        Route("/metrics", h.metrics, methods=["GET"]),
        Route("/mesh", h.mesh, methods=["GET"]),
        Route("/mesh/eplb", h.mesh_eplb, methods=["GET"]),
        Route(
            "/openapi.json",
            _openapi(
                build_openapi(model, max_body_bytes=max_body_bytes, requires_api_key=bool(api_key))
            ),
            methods=["GET"],
        ),
    ]
    app = Starlette(
        routes=routes, exception_handlers={MeshError: _mesh_error, HTTPException: _http_error}
    )
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app
