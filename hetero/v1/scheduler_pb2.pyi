from hetero.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority", "lora_adapter", "pooling", "cache_salt", "follower_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    FOLLOWER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    priority: int
    lora_adapter: str
    pooling: _common_pb2.Pooling
    cache_salt: str
    follower_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., lora_adapter: _Optional[str] = ..., pooling: _Optional[_Union[_common_pb2.Pooling, str]] = ..., cache_salt: _Optional[str] = ..., follower_id: _Optional[str] = ...) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("follower_id",)
    FOLLOWER_ID_FIELD_NUMBER: _ClassVar[int]
    follower_id: str
    def __init__(self, follower_id: _Optional[str] = ...) -> None: ...

class TokenEventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[TokenEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[TokenEvent, _Mapping]]] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "error", "cached_prompt_tokens", "index", "logprobs", "token_timestamps", "top_logprobs", "queue_seconds", "prompt_logprobs", "prompt_top_logprobs", "position", "draft_tokens", "accepted_draft_tokens", "embedding")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    error: str
    cached_prompt_tokens: int
    index: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_timestamps: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    queue_seconds: float
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    position: int
    draft_tokens: int
    accepted_draft_tokens: int
    embedding: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., error: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., token_timestamps: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., queue_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., position: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., embedding: _Optional[_Iterable[float]] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("index", "address", "up", "pid", "pool")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    up: bool
    pid: int
    pool: _common_pb2.PoolStats
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ..., up: _Optional[bool] = ..., pid: _Optional[int] = ..., pool: _Optional[_Union[_common_pb2.PoolStats, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason", "index", "any_tenant")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ANY_TENANT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: _common_pb2.FinishReason
    index: int
    any_tenant: bool
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., index: _Optional[int] = ..., any_tenant: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("pool", "model", "max_model_len", "attention_backend", "device", "service", "replicas", "architecture", "num_experts", "num_experts_per_tok")
    POOL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    pool: _common_pb2.PoolStats
    model: str
    max_model_len: int
    attention_backend: str
    device: str
    service: _common_pb2.ServiceStats
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    architecture: str
    num_experts: int
    num_experts_per_tok: int
    def __init__(self, pool: _Optional[_Union[_common_pb2.PoolStats, _Mapping]] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., attention_backend: _Optional[str] = ..., device: _Optional[str] = ..., service: _Optional[_Union[_common_pb2.ServiceStats, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., architecture: _Optional[str] = ..., num_experts: _Optional[int] = ..., num_experts_per_tok: _Optional[int] = ...) -> None: ...

class SuspendRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: _common_pb2.KVCacheManagementMode
    def __init__(self, mode: _Optional[_Union[_common_pb2.KVCacheManagementMode, str]] = ...) -> None: ...

class SuspendResponse(_message.Message):
    __slots__ = ("mode", "released_bytes")
    MODE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    mode: _common_pb2.KVCacheManagementMode
    released_bytes: int
    def __init__(self, mode: _Optional[_Union[_common_pb2.KVCacheManagementMode, str]] = ..., released_bytes: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
