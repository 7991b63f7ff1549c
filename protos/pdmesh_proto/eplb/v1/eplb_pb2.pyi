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
    __slots__ = ("instance", "model", "placement_version")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    instance: str
    model: str
    placement_version: int
    def __init__(self, instance: _Optional[str] = ..., model: _Optional[str] = ..., placement_version: _Optional[int] = ...) -> None: ...
