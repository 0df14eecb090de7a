"""The OpenAI-style HTTP request bodies, as `/openapi.json` publishes them.

One rule: every field is honoured or refused with a 400 naming it.
- Unknown fields are refused (`extra="forbid"`), in messages and `stream_options` too.
- Fields OpenAI or vLLM define that we do not serve are declared, accepted at their default
  and refused otherwise (`fields`).
- Every number is range-checked here, so that no value reaches protobuf out of range (a
  uint32 field given -1 or 2**40 would raise inside the protobuf conversion: a 500). NaN and
  infinities are refused. Checks that need the model (token ids < vocabulary size) are made
  when the bodies are translated (`schema`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.openai.fields import CHAT, COMPLETION, MESSAGE, refuse_unserved
from hetero_common.errors import ValidationError
from hetero_common.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; refused when true

    @model_validator(mode="after")
    def _unserved(self) -> "StreamOptions":
        refuse_unserved({k: getattr(self, k) for k in self.model_fields_set}, COMPLETION, "stream_options.")
        return self


class _Body(StrictBody):
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=UINT32_MAX, description="vLLM's: -1 or 0 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, description="1 = off")
    min_tokens: int = Field(0, ge=0, le=UINT32_MAX)
    logit_bias: dict[str, Bias] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    priority: int = Field(0, ge=INT32_MIN, le=INT32_MAX, description="lower is served first")
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=1024, description="OpenAI's end-user id: accepted, informational only")
    # Structured output (openai.structured); the guided_* fields are vLLM's older names.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Declared so that they are refused by name, not as unknown (openai.fields.COMMON).
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_size(cls, bias: Any) -> Any:
        """Refused before its entries are validated: 200k of them held the event loop for 0.1 s."""
        if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS:
            raise ValidationError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed", "logit_bias")
        return bias

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValidationError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValidationError("stop must not contain empty strings", "stop")
        return stop

    def sent(self) -> dict[str, Any]:
        """The fields the client sent, with their values."""
        return {name: getattr(self, name) for name in self.model_fields_set}

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValidationError("stream_options is only allowed with stream: true", "stream_options")


def _prompt_error(message: str, param: str = "prompt") -> ValidationError:
    return ValidationError(f"{param}: {message}", param)


def check_prompt_form(prompt: Any, param: str = "prompt") -> Any:
    """OpenAI's four prompt forms (a completion's `prompt`, an embedding's `input`), checked by hand so the error names the element at fault
    (pydantic would report one error per form of the union)."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise _prompt_error("must be a string, a list of strings, a list of token ids or a list of lists of them", param)
    if not prompt:
        raise _prompt_error("must not be empty", param)

    def token_ids(ids: list[Any], where: str) -> None:
        for j, t in enumerate(ids):
            if type(t) is not int or not 0 <= t <= UINT32_MAX:
                raise _prompt_error(f"token ids must be integers in [0, vocabulary size) (got {t!r})", f"{where}[{j}]")

    if all(isinstance(p, str) for p in prompt):
        return prompt
    if all(type(p) is int for p in prompt):
        token_ids(prompt, param)
        return prompt
    if not all(isinstance(p, list) for p in prompt):
        raise _prompt_error("a list holds strings only, token ids only, or lists of token ids only", param)
    for i, p in enumerate(prompt):
        if not p:
            raise _prompt_error("must not be empty", f"{param}[{i}]")
        token_ids(p, f"{param}[{i}]")
    return prompt


class CompletionBody(_Body):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=0, le=UINT32_MAX, description="0 only with echo or prompt_logprobs")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="served only when equal to n")
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_embeds: str | list[str] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, prompt: Any) -> Any:
        return check_prompt_form(prompt)

    @model_validator(mode="after")
    def _contract(self) -> "CompletionBody":
        refuse_unserved(self.sent(), COMPLETION)
        self._check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise ValidationError(f"best_of={self.best_of} with n={self.n}: only best_of == n is served "
                                  "(every sample is returned)", "best_of")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ValidationError("max_tokens must be >= 1 (0 is allowed only with echo or prompt_logprobs: "
                                  "the prompt is scored, nothing is generated)", "max_tokens")
        _check_min_tokens(self.min_tokens, self.max_tokens)
        return self


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessageBody(StrictBody):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # given to the chat template (a tool message's: the function's name)
    refusal: str | None = None  # OpenAI's assistant refusal text, when a client echoes a reply back
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made (openai.tools)
    tool_call_id: str | None = None  # tool: the call this message answers
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatBody(_Body):
    messages: list[ChatMessageBody] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None  # checked in openai.tools
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted: `auto` answers may hold several calls, `required` one
    # Declared so that they are refused by name, not as unknown (openai.fields.CHAT).
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = Field(None, max_length=1024, description="informational, as user")
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _contract(self) -> "ChatBody":
        refuse_unserved(self.sent(), CHAT)
        for i, message in enumerate(self.messages):
            refuse_unserved({k: getattr(message, k) for k in message.model_fields_set}, MESSAGE, f"messages[{i}].")
        self._check_common()
        if self.top_logprobs and not self.logprobs:
            raise ValidationError("top_logprobs requires logprobs: true", "top_logprobs")
        _check_min_tokens(self.min_tokens, self.effective_max_tokens)
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _check_min_tokens(min_tokens: int, max_tokens: int | None) -> None:
    if max_tokens is not None and min_tokens > max_tokens:
        raise ValidationError(f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
