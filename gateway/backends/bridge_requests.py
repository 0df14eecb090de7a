"""What the command bridge takes from a request, and what it refuses, before any program starts.

The program's environment is its one contract with the gateway: the prompt in `HETERO_PROMPT`
(a chat rendered with the model's template: `bridge_prompt`), the sampling parameters in
`HETERO_*` variables, and only the gateway's own variables named in `serving.backend.command_env`
(so its API keys never reach the program). Refused with INVALID_ARGUMENT naming the field: what
cannot go into an environment (a prompt or stop strings over what Linux allows one variable, a
NUL, a lone surrogate), and what a program cannot honour (logits controls, tools, constraints).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from gateway.text.chat import render_chat
from hetero.v1 import inference_pb2
from hetero_common.errors import ValidationError
from hetero_common.sampling import MAX_STOP_STRINGS, Sampling
from hetero_common.tokenizer import TextTokenizer

# Linux caps one "NAME=value" environment string at MAX_ARG_STRLEN (32 pages: 128 KiB, its NUL
# included); past it exec fails with E2BIG. A prompt is refused short of that, not failed.
MAX_ENV_STRING_BYTES = 32 * 4096
# The stop strings' JSON in HETERO_STOP: a quarter of one variable's cap, so that the prompt's
# variable, the stop strings and the inherited ones stay well inside exec's total (ARG_MAX).
MAX_STOP_BYTES = 32 * 1024


def _env_string_bytes(name: str, value: str, param: str) -> int:
    """The size of `NAME=value\\0` as exec passes it; a NUL or an unencodable character (a lone
    surrogate) is the request's fault, refused naming its field."""
    if "\x00" in value:
        raise ValidationError(f"{param} holds a NUL character, which the command bridge cannot pass in {name}", param)
    try:
        return len(name) + 1 + len(os.fsencode(value)) + 1
    except UnicodeEncodeError:
        raise ValidationError(f"{param} holds a character that is not valid UTF-8 (a lone surrogate), which the "
                              f"command bridge cannot pass in {name}", param) from None


def bridge_stop(stop: Sequence[str]) -> str:
    """HETERO_STOP (a JSON list; json escapes NULs), refused naming `stop` past the bridge's caps."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValidationError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    encoded = json.dumps(list(stop))
    if _env_string_bytes("HETERO_STOP", encoded, "stop") > MAX_STOP_BYTES:
        raise ValidationError(f"stop strings take {len(encoded.encode())} bytes as the command bridge's HETERO_STOP "
                              f"(a JSON list); at most {MAX_STOP_BYTES} are allowed: send fewer or shorter ones",
                              "stop")
    return encoded


def check_prompt(prompt: str) -> None:
    """The prompt must fit one environment variable (HETERO_PROMPT, the bridge's contract)."""
    size = _env_string_bytes("HETERO_PROMPT", prompt, "prompt")
    if size > MAX_ENV_STRING_BYTES:
        limit = MAX_ENV_STRING_BYTES - len("HETERO_PROMPT=") - 1
        raise ValidationError(f"prompt is {size - len('HETERO_PROMPT=') - 1} bytes in UTF-8; the command bridge "
                              f"passes it in HETERO_PROMPT, and Linux allows one environment variable at most "
                              f"{limit} bytes: shorten the prompt", "prompt")


def bridge_environment(request_id: str, prompt: str, sampling: Sampling, model: str, index: int = 0,
                       inherit: Sequence[str] = ("PATH", "LANG", "LC_ALL", "TZ")) -> dict[str, str]:
    """The program's environment: the gateway's variables named in `inherit` (serving.backend.command_env),
    and the request's HETERO_* ones. Nothing else: the gateway's API keys and secrets stay its own."""
    check_prompt(prompt)
    _env_string_bytes("HETERO_REQUEST_ID", request_id, "request_id")
    env = {name: os.environ[name] for name in inherit if name in os.environ}
    env.update({
        "HETERO_PROMPT": prompt,
        "HETERO_REQUEST_ID": request_id,
        "HETERO_MODEL": model,
        "HETERO_MAX_TOKENS": str(sampling.max_tokens),
        "HETERO_TEMPERATURE": repr(float(sampling.temperature)),
        "HETERO_TOP_P": repr(float(sampling.top_p)),
        "HETERO_TOP_K": str(sampling.top_k),
        "HETERO_STOP": bridge_stop(sampling.stop),
        "HETERO_SAMPLE_INDEX": str(index),  # which of the request's n samples this run answers
    })
    if sampling.seed is not None:
        env["HETERO_SEED"] = str(sampling.seed)
    return env


# SamplingParams controls that act on the model's logits, which the program never shows us: a request
# that sets one (to other than its default) is refused rather than answered as if it had been honoured.
_LOGITS_CONTROL_DEFAULTS = (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0),
                            ("min_p", 0.0), ("min_tokens", 0), ("logit_bias", {}))


def refuse_logits_controls(sampling: Sampling) -> None:
    for name, default in _LOGITS_CONTROL_DEFAULTS:
        if getattr(sampling, name) != default:
            raise ValidationError(f"params.{name} is not supported by the command bridge backend "
                                  "(serving.backend.kind command_bridge); leave it unset")
    if sampling.constraint is not None:  # a program's text cannot be constrained token by token
        raise ValidationError(f"{sampling.constraint.field} (constrained decoding) is not supported by the command "
                              "bridge backend (serving.backend.kind command_bridge); leave the constraint unset",
                              sampling.constraint.kind)


def refuse_tools_and_constraints(request: inference_pb2.GenerateRequest) -> None:
    """A program answers in free text: it can neither be constrained nor asked for tool calls."""
    chat = request.chat if request.WhichOneof("input") == "chat" else None
    if chat is not None and chat.tools and chat.tool_choice != "none":
        raise ValidationError("tools: tool calls (chat.tools) are not served by the command_bridge backend "
                              "(serving.backend.kind command_bridge); send tool_choice none or no tools", "tools")
    kind = request.params.WhichOneof("constraint")
    if kind is not None:
        raise ValidationError(f"params.{kind}: structured output is not served by the command_bridge backend "
                              "(serving.backend.kind command_bridge)", f"params.{kind}")


def bridge_prompt(request: inference_pb2.GenerateRequest, tokenizer: TextTokenizer) -> str:
    """The prompt as text for the program: as sent, the rendered chat, or decoded token ids."""
    kind = request.WhichOneof("input")
    if kind == "prompt":
        return request.prompt
    if kind == "chat":
        return render_chat(tokenizer, request.chat)
    return tokenizer.decode(list(request.prompt_token_ids.ids))
