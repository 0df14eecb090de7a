from hetero.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model_name", "architecture", "vocab_size", "num_layers", "num_kv_heads", "head_dim", "max_position_embeddings", "eos_token_ids", "block_size", "num_blocks", "device", "dtype", "attention_backend", "kv_cache_bytes", "pid", "tensor_parallel_size", "lora_adapters", "max_batch_size", "num_experts", "num_experts_per_tok")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    num_blocks: int
    device: str
    dtype: str
    attention_backend: str
    kv_cache_bytes: int
    pid: int
    tensor_parallel_size: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.LoraAdapter]
    max_batch_size: int
    num_experts: int
    num_experts_per_tok: int
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., attention_backend: _Optional[str] = ..., kv_cache_bytes: _Optional[int] = ..., pid: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[_common_pb2.LoraAdapter, _Mapping]]] = ..., max_batch_size: _Optional[int] = ..., num_experts: _Optional[int] = ..., num_experts_per_tok: _Optional[int] = ...) -> None: ...

class LoadLoraRequest(_message.Message):
    __slots__ = ("slot", "name", "path")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    slot: int
    name: str
    path: str
    def __init__(self, slot: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadLoraRequest(_message.Message):
    __slots__ = ("slot",)
    SLOT_FIELD_NUMBER: _ClassVar[int]
    slot: int
    def __init__(self, slot: _Optional[int] = ...) -> None: ...

class UnloadLoraResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "params", "num_generated", "lora_slot", "pooling")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOT_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    num_generated: int
    lora_slot: int
    pooling: _common_pb2.Pooling
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_generated: _Optional[int] = ..., lora_slot: _Optional[int] = ..., pooling: _Optional[_Union[_common_pb2.Pooling, str]] = ...) -> None: ...

class ScheduledSequence(_message.Message):
    __slots__ = ("seq_id", "num_tokens", "new_block_ids", "sample", "num_cached_tokens", "draft_token_ids", "num_draft_model_tokens", "block_table_edits")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_MODEL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_EDITS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_tokens: int
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    num_cached_tokens: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_model_tokens: int
    block_table_edits: _containers.RepeatedCompositeFieldContainer[BlockTableEdit]
    def __init__(self, seq_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., num_cached_tokens: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., num_draft_model_tokens: _Optional[int] = ..., block_table_edits: _Optional[_Iterable[_Union[BlockTableEdit, _Mapping]]] = ...) -> None: ...

class BlockTableEdit(_message.Message):
    __slots__ = ("index", "block_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    block_id: int
    def __init__(self, index: _Optional[int] = ..., block_id: _Optional[int] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class SwapBlocks(_message.Message):
    __slots__ = ("seq_id", "block_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_sequences", "scheduled", "released_seq_ids", "block_copies", "reset", "swap_out", "swap_in", "after_step_id")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    scheduled: _containers.RepeatedCompositeFieldContainer[ScheduledSequence]
    released_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    block_copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    reset: bool
    swap_out: _containers.RepeatedCompositeFieldContainer[SwapBlocks]
    swap_in: _containers.RepeatedCompositeFieldContainer[SwapBlocks]
    after_step_id: int
    def __init__(self, step_id: _Optional[int] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., scheduled: _Optional[_Iterable[_Union[ScheduledSequence, _Mapping]]] = ..., released_seq_ids: _Optional[_Iterable[int]] = ..., block_copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., reset: _Optional[bool] = ..., swap_out: _Optional[_Iterable[_Union[SwapBlocks, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[SwapBlocks, _Mapping]]] = ..., after_step_id: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "seq_ids", "token_ids", "logprobs", "forward_seconds", "num_accepted_drafts", "accepted_draft_ids", "accepted_draft_logprobs", "accepted_draft_top_token_ids", "accepted_draft_top_logprobs", "draft_seconds", "draft_proposal_seconds", "expert_tokens", "num_top_logprobs", "top_token_ids", "top_logprobs", "prompt_logprobs", "failures", "embeddings")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROPOSAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    forward_seconds: float
    num_accepted_drafts: _containers.RepeatedScalarFieldContainer[int]
    accepted_draft_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_draft_logprobs: _containers.RepeatedScalarFieldContainer[float]
    accepted_draft_top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_draft_top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    draft_seconds: float
    draft_proposal_seconds: float
    expert_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_top_logprobs: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    failures: _containers.RepeatedCompositeFieldContainer[SampleFailure]
    embeddings: _containers.RepeatedCompositeFieldContainer[PooledEmbedding]
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., forward_seconds: _Optional[float] = ..., num_accepted_drafts: _Optional[_Iterable[int]] = ..., accepted_draft_ids: _Optional[_Iterable[int]] = ..., accepted_draft_logprobs: _Optional[_Iterable[float]] = ..., accepted_draft_top_token_ids: _Optional[_Iterable[int]] = ..., accepted_draft_top_logprobs: _Optional[_Iterable[float]] = ..., draft_seconds: _Optional[float] = ..., draft_proposal_seconds: _Optional[float] = ..., expert_tokens: _Optional[_Iterable[int]] = ..., num_top_logprobs: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[SampleFailure, _Mapping]]] = ..., embeddings: _Optional[_Iterable[_Union[PooledEmbedding, _Mapping]]] = ...) -> None: ...

class PooledEmbedding(_message.Message):
    __slots__ = ("seq_id", "values")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class SampleFailure(_message.Message):
    __slots__ = ("seq_id", "error")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    error: str
    def __init__(self, seq_id: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "first_position", "logprobs", "num_top", "top_token_ids", "top_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    first_position: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_top: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., first_position: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., num_top: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SuspendKVCacheRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: _common_pb2.KVCacheManagementMode
    def __init__(self, mode: _Optional[_Union[_common_pb2.KVCacheManagementMode, str]] = ...) -> None: ...

class SuspendKVCacheResponse(_message.Message):
    __slots__ = ("released_bytes",)
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    released_bytes: int
    def __init__(self, released_bytes: _Optional[int] = ...) -> None: ...

class ResumeKVCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeKVCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
