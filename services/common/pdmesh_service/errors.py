"""Domain errors. Cores raise these; one interceptor maps them to gRPC status codes and the gateway
maps them to HTTP statuses with the OpenAI error shape."""

from __future__ import annotations


class MeshError(Exception):
    """Base of the errors that travel between services with a status code.

    `param` names the request field the error is about and `code` is a machine-readable reason
    (OpenAI's error fields, e.g. param="model", code="model_not_found"); both None when not known.
    Only the message crosses a gRPC hop: `param` and `code` are for the gateway's REST answer.
    """

    grpc_code = "INTERNAL"
    http_status = 500
    error_type = "internal_error"

    def __init__(
        self, message: str = "", *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class InvalidArgument(MeshError, ValueError):
    grpc_code, http_status, error_type = "INVALID_ARGUMENT", 400, "invalid_request_error"


class PayloadTooLarge(InvalidArgument):
    """A request body over the front door's size limit."""

    grpc_code, http_status, error_type = "INVALID_ARGUMENT", 413, "invalid_request_error"


class NotFound(MeshError, KeyError):
    grpc_code, http_status, error_type = "NOT_FOUND", 404, "not_found_error"

    def __str__(self) -> str:  # KeyError quotes its message; we don't
        return str(self.args[0]) if self.args else ""


class FailedPrecondition(MeshError):
    grpc_code, http_status, error_type = "FAILED_PRECONDITION", 409, "conflict_error"


class Aborted(MeshError):
    """A race was lost to another party (e.g. the decode reservation ended first); retry from the
    start."""

    grpc_code, http_status, error_type = "ABORTED", 409, "conflict_error"


class ResourceExhausted(MeshError):
    grpc_code, http_status, error_type = "RESOURCE_EXHAUSTED", 503, "overloaded_error"


class Unavailable(MeshError):
    grpc_code, http_status, error_type = "UNAVAILABLE", 503, "service_unavailable"


class DeadlineExceeded(MeshError):
    grpc_code, http_status, error_type = "DEADLINE_EXCEEDED", 504, "timeout_error"


def require_id(request_id: str) -> str:
    """The request id of an RPC; InvalidArgument when it is empty."""
    if not request_id:
        raise InvalidArgument("request_id is empty")
    return request_id
