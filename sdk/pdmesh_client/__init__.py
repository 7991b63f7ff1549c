"""Client SDK of pdmesh: generate text from a pdmesh gateway over gRPC, synchronously or with
asyncio.

from pdmesh_client import Client
with Client("127.0.0.1:50051") as client:
    print(client.generate("Hello", max_tokens=16, temperature=0).text)
"""

from pdmesh_client.aio import AsyncClient
from pdmesh_client.client import Client
from pdmesh_client.types import (
    Cancelled,
    Chunk,
    Completion,
    GenerateError,
    InvalidRequest,
    ModelNotFound,
    ServiceUnavailable,
    Timeout,
    TokenLogprob,
    Unauthenticated,
    Usage,
)

__all__ = [
    "AsyncClient",
    "Cancelled",
    "Chunk",
    "Client",
    "Completion",
    "GenerateError",
    "InvalidRequest",
    "ModelNotFound",
    "ServiceUnavailable",
    "Timeout",
    "TokenLogprob",
    "Unauthenticated",
    "Usage",
]
__version__ = "0.1.0"
