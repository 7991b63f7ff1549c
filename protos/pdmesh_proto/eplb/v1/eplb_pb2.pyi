from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EplbStatus(_message.Message):
    __slots__ = ("instance_id", "enabled", "models")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    enabled: bool
    models: _containers.RepeatedCompositeFieldContainer[TrackedModel]
    def __init__(self, instance_id: _Optional[str] = ..., enabled: _Optional[bool] = ..., models: _Optional[_Iterable[_Union[TrackedModel, _Mapping]]] = ...) -> None: ...

class TrackedModel(_message.Message):
    __slots__ = ("instance", "model", "placement_version", "ranks", "balancedness", "has_balancedness", "last_rebalance", "enabled", "num_layers", "num_slots", "num_logical", "num_ranks")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    HAS_BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    LAST_REBALANCE_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGICAL_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    instance: str
    model: str
    placement_version: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankVersion]
    balancedness: float
    has_balancedness: bool
    last_rebalance: RebalanceRecord
    enabled: bool
    num_layers: int
    num_slots: int
    num_logical: int
    num_ranks: int
    def __init__(self, instance: _Optional[str] = ..., model: _Optional[str] = ..., placement_version: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankVersion, _Mapping]]] = ..., balancedness: _Optional[float] = ..., has_balancedness: _Optional[bool] = ..., last_rebalance: _Optional[_Union[RebalanceRecord, _Mapping]] = ..., enabled: _Optional[bool] = ..., num_layers: _Optional[int] = ..., num_slots: _Optional[int] = ..., num_logical: _Optional[int] = ..., num_ranks: _Optional[int] = ...) -> None: ...

class RankVersion(_message.Message):
    __slots__ = ("rank", "running_version", "staged_version", "step")
    RANK_FIELD_NUMBER: _ClassVar[int]
    RUNNING_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGED_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    running_version: int
    staged_version: int
    step: int
    def __init__(self, rank: _Optional[int] = ..., running_version: _Optional[int] = ..., staged_version: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class RebalanceRecord(_message.Message):
    __slots__ = ("version", "created_ms", "reason", "num_slots_moved", "num_bytes_moved", "balancedness_before", "balancedness_after", "plan_ms")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_AFTER_FIELD_NUMBER: _ClassVar[int]
    PLAN_MS_FIELD_NUMBER: _ClassVar[int]
    version: int
    created_ms: int
    reason: str
    num_slots_moved: int
    num_bytes_moved: int
    balancedness_before: float
    balancedness_after: float
    plan_ms: float
    def __init__(self, version: _Optional[int] = ..., created_ms: _Optional[int] = ..., reason: _Optional[str] = ..., num_slots_moved: _Optional[int] = ..., num_bytes_moved: _Optional[int] = ..., balancedness_before: _Optional[float] = ..., balancedness_after: _Optional[float] = ..., plan_ms: _Optional[float] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("instance", "model", "force")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    instance: str
    model: str
    force: bool
    def __init__(self, instance: _Optional[str] = ..., model: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("rebalanced", "record", "reason")
    REBALANCED_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rebalanced: bool
    record: RebalanceRecord
    reason: str
    def __init__(self, rebalanced: _Optional[bool] = ..., record: _Optional[_Union[RebalanceRecord, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class SetEnabledRequest(_message.Message):
    __slots__ = ("instance", "enabled")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    instance: str
    enabled: bool
    def __init__(self, instance: _Optional[str] = ..., enabled: _Optional[bool] = ...) -> None: ...

class SetEnabledResponse(_message.Message):
    __slots__ = ("instance", "enabled")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    instance: str
    enabled: bool
    def __init__(self, instance: _Optional[str] = ..., enabled: _Optional[bool] = ...) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ("instance", "model", "version")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    instance: str
    model: str
    version: int
    def __init__(self, instance: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class LayerSlots(_message.Message):
    __slots__ = ("logical",)
    LOGICAL_FIELD_NUMBER: _ClassVar[int]
    logical: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, logical: _Optional[_Iterable[int]] = ...) -> None: ...

class GetPlacementResponse(_message.Message):
    __slots__ = ("instance", "model", "version", "num_ranks", "layers", "created_ms", "history")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    instance: str
    model: str
    version: int
    num_ranks: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerSlots]
    created_ms: int
    history: _containers.RepeatedCompositeFieldContainer[RebalanceRecord]
    def __init__(self, instance: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[int] = ..., num_ranks: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerSlots, _Mapping]]] = ..., created_ms: _Optional[int] = ..., history: _Optional[_Iterable[_Union[RebalanceRecord, _Mapping]]] = ...) -> None: ...
