"""The fields OpenAI and vLLM define that this server does not serve: accepted at their default
value, refused with a 400 naming them otherwise. A silent drop is worse than an error (the
caller trusts the answer), and refusing a default value would break clients that always send
it (e.g. `tools: []`, `store: false`, `response_format: {"type": "text"}`).

Fields nobody defines are refused by the body models themselves (`extra="forbid"`). The
docs/api.md lists this table; keep them in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hetero_common.errors import ValidationError


@dataclass(frozen=True)
class Unserved:
    accepts: Callable[[Any], bool]  # the values that mean "not asked for"
    why: str  # what the caller can do instead, or why it is not served


def _none(v: Any) -> bool:
    return v is None


def _empty(v: Any) -> bool:
    return not v  # None, [], {}, "", False


def _false(v: Any) -> bool:
    return v is None or v is False


def _true(v: Any) -> bool:
    return v is None or v is True


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


_TOOLS = "the deprecated function-calling fields are not served; send tools and tool_choice"

# Both routes.
COMMON: dict[str, Unserved] = {
    # response_format, structured_outputs and guided_json/regex/choice/grammar are served (openai.structured).
    "guided_decoding_backend": Unserved(_none, "one structured-output backend (llguidance) is served"),
    "guided_whitespace_pattern": Unserved(_none, "JSON is always compact"),
    "use_beam_search": Unserved(_false, "beam search is not served"),
    "length_penalty": Unserved(_is(1.0, 1), "length_penalty applies to beam search, which is not served"),
    "include_stop_str_in_output": Unserved(_false, "stop strings are never included in the output"),
    "spaces_between_special_tokens": Unserved(_true, "special tokens are detokenized as they are"),
    "truncate_prompt_tokens": Unserved(_none, "prompts are never truncated; shorten the prompt"),
    "allowed_token_ids": Unserved(_none, "send logit_bias instead"),
    "bad_words": Unserved(_empty, "send logit_bias instead"),
    "return_tokens_as_token_ids": Unserved(_false, "not served"),
    "return_token_ids": Unserved(_false, "not served; the gRPC API returns token ids"),
    "kv_transfer_params": Unserved(_none, "disaggregated serving is not served"),
    "vllm_xargs": Unserved(_none, "no extensions take extra arguments here"),
    "continuous_usage_stats": Unserved(_false, "usage comes once, at the end (include_usage)"),
}

COMPLETION: dict[str, Unserved] = {
    **COMMON,
    "suffix": Unserved(_empty, "insertion (fill in the middle) is not served"),
    "prompt_embeds": Unserved(_none, "prompts are text or token ids"),
    # best_of == n is served (every sample is returned); see CompletionBody.
}

CHAT: dict[str, Unserved] = {
    **COMMON,
    # tools, tool_choice and parallel_tool_calls are served (openai.tools).
    "functions": Unserved(_empty, _TOOLS),
    "function_call": Unserved(_is("none"), f"{_TOOLS}; only \"none\" is accepted"),
    "store": Unserved(_false, "completions are not stored"),
    "metadata": Unserved(_empty, "metadata goes with stored completions, which are not served"),
    "modalities": Unserved(lambda v: v is None or v == ["text"], "only text output is served"),
    "audio": Unserved(_none, "only text output is served"),
    "prediction": Unserved(_none, "predicted outputs are not served"),
    "reasoning_effort": Unserved(_none, "reasoning controls are not served"),
    "service_tier": Unserved(_is("auto", "default"), "one service tier is served"),
    "web_search_options": Unserved(_none, "web search is not served"),
    "prompt_cache_key": Unserved(_none, "prefix caching is automatic; send cache_salt to separate tenants"),
    "echo": Unserved(_false, "the last message is not returned with the completion"),
    "add_generation_prompt": Unserved(_true, "the assistant's generation prompt is always added"),
    "continue_final_message": Unserved(_false, "a final message is not continued"),
    "add_special_tokens": Unserved(_false, "the chat template writes the special tokens"),
    "documents": Unserved(_none, "the chat template takes no documents"),
    "chat_template": Unserved(_none, "the model's own chat template is used"),
    "chat_template_kwargs": Unserved(_empty, "the chat template takes no extra arguments"),
    "mm_processor_kwargs": Unserved(_none, "only text is served"),
}

MESSAGE: dict[str, Unserved] = {
    "function_call": Unserved(_none, _TOOLS),
    "audio": Unserved(_none, "only text is served"),
}


def refuse_unserved(values: dict[str, Any], table: dict[str, Unserved], prefix: str = "") -> None:
    """Raise ValidationError naming the first field of `values` (the fields the client sent)
    that `table` lists with a value other than its default."""
    for name, value in values.items():
        rule = table.get(name)
        if rule is not None and not rule.accepts(value):
            param = f"{prefix}{name}"
            raise ValidationError(f"{param}: {rule.why}; this server does not serve {param}={_short(value)}",
                                  param=param)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
