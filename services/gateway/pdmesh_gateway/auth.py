"""The front door's API key (`--api-key`): what a request must carry, and where.

`check_authorization(header, api_key)` is the pure check: the value of an `Authorization` header
(HTTP) or `authorization` metadata (gRPC) must be `Bearer <api_key>`, compared in constant time;
else `InvalidApiKey`, which the REST app answers 401 in the OpenAI error shape
({"error": {"message", "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}})
and gRPC as UNAUTHENTICATED. With a key table (`--api-keys-file`, `tenants.Tenants`) any of its keys
is accepted (and the single `--api-key` too, when both are given: `Keys`). The two adapters install
it:
- `ApiKeyMiddleware` (ASGI) guards the REST routes under /v1 (as vLLM's --api-key does) and /mesh
  (it lists internal addresses); /health, /metrics and the rest stay open for probes and scrapers.
- `api_key_interceptor` guards every gRPC method but the standard health and reflection services.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pdmesh_gateway.openai_api import error_body
from pdmesh_gateway.tenants import Tenants
from pdmesh_service.errors import MeshError
from pdmesh_service.grpc_server import AuthInterceptor, Metadata, metadata_value, secret_matches

PROTECTED_PREFIXES = ("/v1", "/mesh")
AUTHORIZATION = "authorization"  # the HTTP header and the gRPC metadata key (lower case)
SCHEME = "bearer"


class Keys:
    """The keys a front door accepts: the single `--api-key` and/or a tenants' key table."""

    def __init__(self, api_key: str = "", tenants: Tenants | None = None) -> None:
        if not api_key and tenants is None:
            raise ValueError("Keys needs an API key or a key table")
        self.api_key, self.tenants = api_key, tenants

    def accepts(self, token: str) -> bool:
        is_single = bool(self.api_key) and secret_matches(token, self.api_key)
        return is_single or (self.tenants is not None and self.tenants.lookup(token) is not None)


class InvalidApiKey(MeshError):
    """The request carried no API key, or a wrong one (what OpenAI answers: 401,
    invalid_request_error, code invalid_api_key)."""

    grpc_code, http_status, error_type = "UNAUTHENTICATED", 401, "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


def is_protected(path: str) -> bool:
    """Whether the REST route at `path` needs the key: /v1 and /mesh and everything under them."""
    return any(path == p or path.startswith(p + "/") for p in PROTECTED_PREFIXES)


def check_authorization(header: str | None, api_key: str | Keys) -> None:
    """Nothing when `header` is `Bearer <api_key>` (the scheme in any case; with `Keys`, any key
    they accept); else InvalidApiKey, whose message never repeats what was sent."""
    scheme, _, token = (header or "").strip().partition(" ")
    if not header or scheme.lower() != SCHEME or not token.strip():
        raise InvalidApiKey(
            "no API key: send it in the Authorization header as 'Authorization: Bearer <key>'"
        )
    token = token.strip()
    if isinstance(api_key, Keys):
        is_accepted = api_key.accepts(token)
    else:
        is_accepted = secret_matches(token, api_key)
    if not is_accepted:
        raise InvalidApiKey("incorrect API key")


class ApiKeyMiddleware:
    """ASGI: a request to a protected route without the key is answered 401 before routing."""

    def __init__(self, app: ASGIApp, api_key: str | Keys) -> None:
        if not api_key:
            raise ValueError("ApiKeyMiddleware needs a key")
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_protected(scope["path"]):
            header = _header(scope, AUTHORIZATION.encode())
            try:
                check_authorization(header, self.api_key)
            except InvalidApiKey as e:
                response = JSONResponse(
                    error_body(e), status_code=e.http_status, headers={"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def api_key_interceptor(api_key: str | Keys) -> AuthInterceptor:
    """The gRPC front door's check: metadata `authorization: Bearer <api_key>`."""
    if not api_key:
        raise ValueError("api_key_interceptor needs a key")

    def refusal(metadata: Metadata | None) -> str | None:
        try:
            check_authorization(metadata_value(metadata, AUTHORIZATION), api_key)
        except InvalidApiKey as e:
            return str(e)
        return None

    return AuthInterceptor(refusal)
