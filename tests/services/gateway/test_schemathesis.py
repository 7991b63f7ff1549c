"""The gateway's OpenAPI document: it is valid, it lists exactly the app's routes, and the app keeps
to it under schemathesis (every operation, schema-valid and schema-violating bodies).

The app runs in-process over an orchestrator whose generation is a script (a unit test of the REST
layer: no workers, Redis or gRPC), so the successful paths, streaming included, are exercised.
Checks: no 5xx, every status and body as documented, every body the document forbids refused with a
4xx, and every `data:` chunk of a stream valid against the chunk schema the document names.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from prometheus_client import CollectorRegistry
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from schemathesis.openapi.checks import JsonSchemaError
from starlette.applications import Starlette
from starlette.routing import Route

from pdmesh_engine import sampling
from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_gateway.core import (
    GenerationEvent,
    GenerationRequest,
    ModelInfo,
    TokenLogprob,
    Usage,
)
from pdmesh_gateway.metrics import GatewayMetrics
from pdmesh_gateway.openai_api import SAMPLING_BODY_FIELDS, UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION
from pdmesh_gateway.openapi import build_openapi
from pdmesh_gateway.orchestrator import Orchestrator
from pdmesh_gateway.rest import create_app
from pdmesh_gateway.router import Router
from pdmesh_service.eplb_protocol import EplbSummary, RebalanceRecord
from pdmesh_service.instance import InstanceInfo, Role

MAX_BODY = 1 << 20
API_KEY = "sk-test"
MAX_EXAMPLES = 30  # per operation and mode
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
# any 4xx is a rejection (the default list lacks 413, the answer to a body over --max-body-mb)
CONFIG = {"checks": {"negative_data_rejection": {"expected-statuses": ["4XX"]}}}
OPERATIONS = [
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/health"),
    ("GET", "/health/live"),
    ("GET", "/health/ready"),
    ("GET", "/metrics"),
    ("GET", "/mesh"),
    ("GET", "/mesh/eplb"),
]
CHUNK_SCHEMA = {"/v1/completions": "CompletionChunk", "/v1/chat/completions": "ChatCompletionChunk"}


class ScriptedOrchestrator(Orchestrator):
    """Generation replaced by a script: up to 3 tokens (finish "length" at max_tokens, else
    "stop"), with logprobs and `logprobs` alternatives when asked for."""

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        num_tokens = min(request.params.max_tokens, 3)
        k = request.params.logprobs
        for i in range(num_tokens):
            token = 100 + i
            top = tuple((t, -1.0 - t / 100) for t in range(k or 0))
            logprobs = () if k is None else (TokenLogprob(token, -0.5, top),)
            last = i == num_tokens - 1
            finish = (
                ("length" if num_tokens == request.params.max_tokens else "stop") if last else None
            )
            usage = Usage(len(request.prompt_ids), num_tokens) if last else None
            text = self.tokenizer.decode([token])
            yield GenerationEvent((token,), text, logprobs, finish, None, usage)


async def _eplb_rows() -> list[dict[str, Any]]:
    """What /mesh and /mesh/eplb list: one instance rebalanced once, one never."""
    record = RebalanceRecord(2, 1_700_000_000_000, "interval", 12, 12 << 20, 0.5, 0.9, 3.5)
    return [
        EplbSummary("decode-0", "target", 2, (), 0.9, record, True).to_dict(),
        EplbSummary("prefill-0", "draft", 0, (), None, None, None).to_dict(),
    ]


@pytest.fixture(scope="module")
def app(tok: Tokenizer, model: ModelInfo) -> Iterator[Starlette]:
    router = Router()
    router.update([InstanceInfo("decode-0", Role.DECODE, "127.0.0.1:1", model="tiny", ready=True)])
    orchestrator = ScriptedOrchestrator(router, tok, metrics=GatewayMetrics(CollectorRegistry()))
    yield create_app(
        orchestrator, tok, model, CollectorRegistry(), eplb=_eplb_rows, max_body_bytes=MAX_BODY
    )
    asyncio.run(orchestrator.close())


@pytest.fixture(scope="module")
def schema(app: Starlette) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_asgi(
        "/openapi.json", app, config=schemathesis.Config.from_dict(CONFIG)
    )


@pytest.fixture(scope="module")
def document(model: ModelInfo) -> dict[str, Any]:
    return build_openapi(model, max_body_bytes=MAX_BODY)


def _routes(app: Starlette) -> set[tuple[str, str]]:
    """(METHOD, path) of every route; HEAD, which Starlette adds to each GET, left out."""
    return {
        (method, route.path)
        for route in app.routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    }


def _documented(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m.upper(), path) for path, item in document["paths"].items() for m in item}


def test_the_document_lists_exactly_the_routes_of_the_app(app, schema, document) -> None:
    served = schema.raw_schema
    assert served == json.loads(json.dumps(document))  # what GET /openapi.json returns
    assert _documented(served) == _routes(app)
    assert {(m, p) for m, p in _routes(app) if p != "/openapi.json"} == set(OPERATIONS)


def test_the_document_is_valid_openapi_and_a_broken_one_is_not(document) -> None:
    schemathesis.openapi.from_dict(document).validate()
    broken = copy.deepcopy(document)
    broken["paths"]["/health"]["get"]["responses"] = {"200": {"content": {}}}  # no description
    with pytest.raises(Exception, match="description"):
        schemathesis.openapi.from_dict(broken).validate()


def _non_null(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema of a field's non-null values."""
    return next(s for s in schema["anyOf"] if s != {"type": "null"})


def test_the_request_schemas_name_every_field_the_parsers_read(document, model) -> None:
    schemas = document["components"]["schemas"]
    for name, unsupported in (
        ("CompletionRequest", UNSUPPORTED_COMPLETION),
        ("ChatCompletionRequest", UNSUPPORTED_CHAT),
    ):
        properties = schemas[name]["properties"]
        assert set(SAMPLING_BODY_FIELDS) | set(unsupported) | {"max_tokens", "logprobs"} <= set(
            properties
        )
        assert _non_null(properties["temperature"])["maximum"] == sampling.MAX_TEMPERATURE
        assert properties["model"]["enum"][:2] == [model.name, model.root]
        ids = _non_null(properties["stop_token_ids"])
        assert ids["items"]["maximum"] == model.vocab_size - 1
        assert properties["n"]["enum"] == [1, None]
        for field in set(properties) - {"prompt", "messages"}:  # null: the default
            jsonschema.validate(None, {**document, **properties[field]})
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert _non_null(chat["top_logprobs"])["maximum"] == sampling.MAX_LOGPROBS
    assert _non_null(chat["logprobs"]) == {"type": "boolean"}
    assert {"messages", "max_completion_tokens", "add_generation_prompt"} <= set(chat)


def test_an_api_key_adds_a_bearer_scheme_and_401_where_the_key_is_needed(tok, model) -> None:
    router = Router()
    orchestrator = ScriptedOrchestrator(router, tok, metrics=GatewayMetrics(CollectorRegistry()))
    app = create_app(orchestrator, tok, model, CollectorRegistry(), api_key=API_KEY)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)  # the document is not guarded
    schema.validate()
    document = schema.raw_schema
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    guarded = {
        p
        for p, item in document["paths"].items()
        if "security" in item["get" if "get" in item else "post"]
    }
    assert guarded == {
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/mesh",
        "/mesh/eplb",
    }
    for path in guarded:
        assert all("401" in op["responses"] for op in document["paths"][path].values())
    models = schema["/v1/models"]["GET"]
    refused = models.Case().call()
    assert refused.status_code == 401
    models.Case().validate_response(refused, checks=CHECKS)
    ok = models.Case(headers={"Authorization": f"Bearer {API_KEY}"}).call()
    assert ok.status_code == 200
    models.Case().validate_response(ok, checks=CHECKS)
    asyncio.run(orchestrator.close())


def _check_stream(document: dict[str, Any], path: str, response: Any) -> int:
    """Every `data:` chunk of an event stream is valid against the chunk schema the document names
    (or is an Error); the stream ends with [DONE]. Returns how many chunks there were (0: not a
    stream)."""
    content_types = {k.lower(): v for k, v in response.headers.items()}.get("content-type", [""])
    if not content_types[0].startswith("text/event-stream"):
        return 0
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", response.text
    chunk = {**document, "$ref": f"#/components/schemas/{CHUNK_SCHEMA[path]}"}
    error = {**document, "$ref": "#/components/schemas/Error"}
    for event in events[:-1]:
        body = json.loads(event)
        jsonschema.validate(body, error if "error" in body else chunk)
    return len(events) - 1


def _strategy(operation: Any, mode: str) -> SearchStrategy[schemathesis.Case]:
    """Cases of `operation`: drawn from its schema (positive / negative) or its examples."""
    if mode == "examples":
        return st.one_of(*operation.get_strategies_from_examples())
    return operation.as_strategy(generation_mode=GenerationMode(mode))


@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [(m, p, "positive") for m, p in OPERATIONS]
    + [(m, p, mode) for m, p in OPERATIONS if m == "POST" for mode in ("negative", "examples")],
)
def test_the_app_keeps_to_its_document(schema, document, method, path, mode) -> None:
    operation = schema[path][method]
    statuses: dict[int, int] = {}
    chunks = []

    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_strategy(operation, mode))
    def run(case: schemathesis.Case) -> None:
        response = case.call(timeout=30)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=CHECKS)
        chunks.append(_check_stream(document, path, response))

    run()
    if mode == "negative":
        assert set(statuses) <= {400, 404, 413}, statuses
    elif mode == "examples":  # every example is served, streamed ones included
        assert set(statuses) == {200} and any(chunks), (statuses, chunks)
    elif method == "POST":  # some bodies pass the schema yet not the context: 400
        assert statuses.get(200), statuses


def test_the_checks_catch_a_document_that_lies(app, document) -> None:
    """A response schema the app does not keep to fails the conformance check."""
    lying = copy.deepcopy(document)
    lying["components"]["schemas"]["ModelList"]["properties"]["object"] = {"const": "models"}
    schema = schemathesis.openapi.from_dict(lying, config=schemathesis.Config.from_dict(CONFIG))
    schema.app = app
    case = schema["/v1/models"]["GET"].Case()
    with pytest.raises(FailureGroup) as info:
        case.call_and_validate(checks=CHECKS)
    [failure] = info.value.exceptions
    assert isinstance(failure, JsonSchemaError) and '"models" was expected' in str(failure)
