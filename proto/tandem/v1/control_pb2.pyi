from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_STARTING: _ClassVar[ReplicaState]
    REPLICA_STATE_READY: _ClassVar[ReplicaState]
    REPLICA_STATE_DRAINING: _ClassVar[ReplicaState]
    REPLICA_STATE_FAILED: _ClassVar[ReplicaState]
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_STARTING: ReplicaState
REPLICA_STATE_READY: ReplicaState
REPLICA_STATE_DRAINING: ReplicaState
REPLICA_STATE_FAILED: ReplicaState

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "tier", "state", "address", "in_flight", "ranks", "age_seconds", "restarts")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    tier: str
    state: ReplicaState
    address: str
    in_flight: int
    ranks: int
    age_seconds: float
    restarts: int
    def __init__(self, replica_id: _Optional[str] = ..., tier: _Optional[str] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., address: _Optional[str] = ..., in_flight: _Optional[int] = ..., ranks: _Optional[int] = ..., age_seconds: _Optional[float] = ..., restarts: _Optional[int] = ...) -> None: ...

class TierStatus(_message.Message):
    __slots__ = ("tier", "desired", "ready", "draining", "starting", "replicas", "refused")
    TIER_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    desired: int
    ready: int
    draining: int
    starting: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    refused: str
    def __init__(self, tier: _Optional[str] = ..., desired: _Optional[int] = ..., ready: _Optional[int] = ..., draining: _Optional[int] = ..., starting: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., refused: _Optional[str] = ...) -> None: ...

class SetReplicasRequest(_message.Message):
    __slots__ = ("tier", "replicas")
    TIER_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    replicas: int
    def __init__(self, tier: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class SetReplicasResponse(_message.Message):
    __slots__ = ("tier",)
    TIER_FIELD_NUMBER: _ClassVar[int]
    tier: TierStatus
    def __init__(self, tier: _Optional[_Union[TierStatus, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStatus]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStatus, _Mapping]]] = ...) -> None: ...

class DrainReplicaRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class DrainReplicaResponse(_message.Message):
    __slots__ = ("replica",)
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    replica: ReplicaStatus
    def __init__(self, replica: _Optional[_Union[ReplicaStatus, _Mapping]] = ...) -> None: ...
