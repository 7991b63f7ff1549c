from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandoffState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDOFF_STATE_UNSPECIFIED: _ClassVar[HandoffState]
    HANDOFF_STATE_RESERVED: _ClassVar[HandoffState]
    HANDOFF_STATE_TRANSFERRING: _ClassVar[HandoffState]
    HANDOFF_STATE_READY: _ClassVar[HandoffState]
    HANDOFF_STATE_CONSUMED: _ClassVar[HandoffState]
    HANDOFF_STATE_EXPIRED: _ClassVar[HandoffState]
    HANDOFF_STATE_CANCELLED: _ClassVar[HandoffState]
HANDOFF_STATE_UNSPECIFIED: HandoffState
HANDOFF_STATE_RESERVED: HandoffState
HANDOFF_STATE_TRANSFERRING: HandoffState
HANDOFF_STATE_READY: HandoffState
HANDOFF_STATE_CONSUMED: HandoffState
HANDOFF_STATE_EXPIRED: HandoffState
HANDOFF_STATE_CANCELLED: HandoffState

class AgentInfo(_message.Message):
    __slots__ = ("agent_name", "metadata", "instance_id")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    metadata: bytes
    instance_id: str
    def __init__(self, agent_name: _Optional[str] = ..., metadata: _Optional[bytes] = ..., instance_id: _Optional[str] = ...) -> None: ...

class RegisterAgentResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetAgentRequest(_message.Message):
    __slots__ = ("agent_name",)
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    def __init__(self, agent_name: _Optional[str] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("request_id", "state", "decode_instance", "prefill_instance", "num_blocks", "lease_ms", "updated_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: HandoffState
    decode_instance: str
    prefill_instance: str
    num_blocks: int
    lease_ms: int
    updated_ms: int
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[HandoffState, str]] = ..., decode_instance: _Optional[str] = ..., prefill_instance: _Optional[str] = ..., num_blocks: _Optional[int] = ..., lease_ms: _Optional[int] = ..., updated_ms: _Optional[int] = ...) -> None: ...

class OpenHandoffRequest(_message.Message):
    __slots__ = ("request_id", "decode_instance", "num_blocks", "lease_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decode_instance: str
    num_blocks: int
    lease_ms: int
    def __init__(self, request_id: _Optional[str] = ..., decode_instance: _Optional[str] = ..., num_blocks: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class UpdateHandoffRequest(_message.Message):
    __slots__ = ("request_id", "state", "prefill_instance", "expected_state")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_STATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: HandoffState
    prefill_instance: str
    expected_state: HandoffState
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[HandoffState, str]] = ..., prefill_instance: _Optional[str] = ..., expected_state: _Optional[_Union[HandoffState, str]] = ...) -> None: ...

class GetHandoffRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class KVEvents(_message.Message):
    __slots__ = ("rank_id", "seq", "stored", "removed", "snapshot")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    seq: int
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    snapshot: bool
    def __init__(self, rank_id: _Optional[str] = ..., seq: _Optional[int] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class KVEventsAck(_message.Message):
    __slots__ = ("resync",)
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    resync: bool
    def __init__(self, resync: _Optional[bool] = ...) -> None: ...

class LongestPrefixRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LongestPrefixResponse(_message.Message):
    __slots__ = ("matched_blocks",)
    class MatchedBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    matched_blocks: _containers.ScalarMap[str, int]
    def __init__(self, matched_blocks: _Optional[_Mapping[str, int]] = ...) -> None: ...
