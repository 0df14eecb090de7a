from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_DEADLINE: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]

class Pooling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_UNSPECIFIED: _ClassVar[Pooling]
    POOLING_LAST: _ClassVar[Pooling]
    POOLING_MEAN: _ClassVar[Pooling]
    POOLING_CLS: _ClassVar[Pooling]

class KVCacheManagementMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_MANAGEMENT_MODE_UNSPECIFIED: _ClassVar[KVCacheManagementMode]
    KV_CACHE_MANAGEMENT_MODE_PERSIST: _ClassVar[KVCacheManagementMode]
    KV_CACHE_MANAGEMENT_MODE_OFFLOAD: _ClassVar[KVCacheManagementMode]
    KV_CACHE_MANAGEMENT_MODE_RECOMPUTE: _ClassVar[KVCacheManagementMode]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_DEADLINE: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
POOLING_UNSPECIFIED: Pooling
POOLING_LAST: Pooling
POOLING_MEAN: Pooling
POOLING_CLS: Pooling
KV_CACHE_MANAGEMENT_MODE_UNSPECIFIED: KVCacheManagementMode
KV_CACHE_MANAGEMENT_MODE_PERSIST: KVCacheManagementMode
KV_CACHE_MANAGEMENT_MODE_OFFLOAD: KVCacheManagementMode
KV_CACHE_MANAGEMENT_MODE_RECOMPUTE: KVCacheManagementMode

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "n", "logprobs", "include_special_tokens", "track_generated_token_events", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "prompt_logprobs", "json_schema", "json_object", "regex", "grammar", "choice")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACK_GENERATED_TOKEN_EVENTS_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    n: int
    logprobs: int
    include_special_tokens: bool
    track_generated_token_events: bool
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    choice: Choices
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., include_special_tokens: _Optional[bool] = ..., track_generated_token_events: _Optional[bool] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_prompt_tokens", "speculative_draft_tokens", "speculative_accepted_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_prompt_tokens: int
    speculative_draft_tokens: int
    speculative_accepted_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., speculative_draft_tokens: _Optional[int] = ..., speculative_accepted_tokens: _Optional[int] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("block_size", "total_blocks", "used_blocks", "free_blocks", "cached_blocks", "usage", "num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "internal_waste", "steps", "num_swapped", "suspended", "steps_planned_ahead", "spec_draft_tokens", "spec_accepted_tokens", "spec_drafted_decodes", "expert_tokens", "expert_step_token_buckets", "expert_step_tokens_sum")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    INTERNAL_WASTE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    STEPS_PLANNED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFTED_DECODES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_STEP_TOKEN_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_STEP_TOKENS_SUM_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    total_blocks: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    usage: float
    num_running: int
    num_waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    internal_waste: float
    steps: int
    num_swapped: int
    suspended: bool
    steps_planned_ahead: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_drafted_decodes: int
    expert_tokens: _containers.RepeatedScalarFieldContainer[int]
    expert_step_token_buckets: _containers.RepeatedScalarFieldContainer[int]
    expert_step_tokens_sum: int
    def __init__(self, block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., internal_waste: _Optional[float] = ..., steps: _Optional[int] = ..., num_swapped: _Optional[int] = ..., suspended: _Optional[bool] = ..., steps_planned_ahead: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., spec_drafted_decodes: _Optional[int] = ..., expert_tokens: _Optional[_Iterable[int]] = ..., expert_step_token_buckets: _Optional[_Iterable[int]] = ..., expert_step_tokens_sum: _Optional[int] = ...) -> None: ...

class ServiceStats(_message.Message):
    __slots__ = ("num_workers", "num_workers_up", "num_deadline_exceeded", "num_rejected_queue_full", "routing_prefix_blocks_queried", "routing_prefix_blocks_hit", "num_recovered_sequences", "lora_adapters_loaded", "lora_slots_in_use")
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_UP_FIELD_NUMBER: _ClassVar[int]
    NUM_DEADLINE_EXCEEDED_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_QUEUE_FULL_FIELD_NUMBER: _ClassVar[int]
    ROUTING_PREFIX_BLOCKS_QUERIED_FIELD_NUMBER: _ClassVar[int]
    ROUTING_PREFIX_BLOCKS_HIT_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOVERED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_LOADED_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    num_workers: int
    num_workers_up: int
    num_deadline_exceeded: int
    num_rejected_queue_full: int
    routing_prefix_blocks_queried: int
    routing_prefix_blocks_hit: int
    num_recovered_sequences: int
    lora_adapters_loaded: int
    lora_slots_in_use: int
    def __init__(self, num_workers: _Optional[int] = ..., num_workers_up: _Optional[int] = ..., num_deadline_exceeded: _Optional[int] = ..., num_rejected_queue_full: _Optional[int] = ..., routing_prefix_blocks_queried: _Optional[int] = ..., routing_prefix_blocks_hit: _Optional[int] = ..., num_recovered_sequences: _Optional[int] = ..., lora_adapters_loaded: _Optional[int] = ..., lora_slots_in_use: _Optional[int] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "rank", "target_modules", "slot", "active_requests")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    slot: int
    active_requests: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., slot: _Optional[int] = ..., active_requests: _Optional[int] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("name", "path", "replace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    replace: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., replace: _Optional[bool] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ("waited_requests",)
    WAITED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    waited_requests: int
    def __init__(self, waited_requests: _Optional[int] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...
