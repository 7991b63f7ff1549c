"""What an instance rank tells the mesh about itself: its role, address, readiness and load (pure
data).

`InstanceInfo` is the registry's record (`pdmesh_service.registry` stores it in Redis); its JSON
form is written and read here only (`to_json` / `from_json`). Unknown JSON keys are ignored, so
ranks of a newer release, which may report more, stay routable by an older gateway. No redis or grpc
here: the gateway's pure router reads these types.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any


class Role(StrEnum):
    """The kinds of process in a mesh (a str, so it compares and serialises as its value)."""

    GATEWAY = "gateway"
    PREFILL = "prefill"
    DECODE = "decode"
    KVSTORE = "kvstore"
    EPLB = "eplb"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Load:
    """A rank's work now and its counters since start, as its heartbeat reports them (all counts).

    The gateway routes decode requests on `num_running + num_waiting`; the rest is for dashboards.
    """

    num_running: int = 0  # requests in the batch
    num_waiting: int = 0  # requests queued (for blocks, for their KV, for a batch slot)
    num_kv_blocks_used: int = 0
    num_kv_blocks_free: int = 0
    num_kv_bytes_sent: int = 0
    num_kv_bytes_received: int = 0
    num_transfer_failures: int = 0
    num_lease_expiries: int = 0
    num_kv_quarantines: int = 0
    num_requests: int = 0  # admitted since start
    num_expert_weight_bytes: int = 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Load:
        """From `asdict` output; unknown keys (a newer rank's counters) are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: int(v) for k, v in values.items() if k in known})


@dataclass(frozen=True)
class InstanceInfo:
    """What an instance rank reports about itself. `role` is coerced to `Role` (ValueError if
    unknown)."""

    instance_id: str
    role: Role
    address: str  # host:port of its gRPC server
    rank: int = 0  # DP rank inside its instance
    dp_size: int = 1
    model: str = ""
    ready: bool = False
    stats: Load = field(default_factory=Load)
    http_port: int = 0  # a gateway's OpenAI REST port; 0 for the other roles
    # its Prometheus port (--metrics-port; also /health/live and /health/ready); 0: none
    metrics_port: int = 0
    # tokens per KV block of a worker whose prefix cache publishes to the kvstore's index; 0: none
    block_size: int = 0
    # a worker's revision (`pdmesh_service.revision`): the gateway pairs a prefill rank only with
    # a decode rank of the same one; "": not reported (another role, or an older worker)
    revision: str = ""
    # a rank stopping (SIGTERM with --drain-s): it finishes what it holds but takes nothing new
    draining: bool = False
    updated_ms: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise ValueError(
                f"role must be one of {[r.value for r in Role]}, got {self.role!r}"
            ) from None
        if not isinstance(self.stats, Load):
            raise ValueError(f"stats must be a Load, got {type(self.stats).__name__}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> InstanceInfo:
        values = json.loads(raw)
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in values.items() if k in known}
        values["stats"] = Load.from_dict(values.get("stats") or {})
        return cls(**values)
