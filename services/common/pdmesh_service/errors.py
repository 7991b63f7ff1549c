"""Domain errors. Cores raise these; one interceptor maps them to gRPC status codes and the gateway
maps them to HTTP statuses with the OpenAI error shape."""
from __future__ import annotations


class MeshError(Exception):
    """Base of the errors that travel between services with a status code."""

    grpc_code = "INTERNAL"
    http_status = 500
    error_type = "internal_error"


class InvalidArgument(MeshError, ValueError):
    grpc_code, http_status, error_type = "INVALID_ARGUMENT", 400, "invalid_request_error"


class NotFound(MeshError, KeyError):
    grpc_code, http_status, error_type = "NOT_FOUND", 404, "not_found_error"

    def __str__(self) -> str:       # KeyError quotes its message; we don't
        return str(self.args[0]) if self.args else ""


class FailedPrecondition(MeshError):
    grpc_code, http_status, error_type = "FAILED_PRECONDITION", 409, "conflict_error"


class Aborted(MeshError):
    """A race was lost to another party (e.g. the decode reservation ended first); retry from the start."""

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
