"""vLLM's tokenizer routes, as lm-evaluation-harness's remote tokenizer probes them:
POST /tokenize (a prompt, or chat messages rendered with the model's template), POST /detokenize,
GET /tokenizer_info. Same bodies and answers as vLLM's (`vllm/entrypoints/serve/tokenize/protocol.py`),
and the same one rule as the generation routes: every field honoured or refused."""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response
from pydantic import Field, model_validator

from gateway.generation import Generation
from gateway.openai.bodies import UINT32_MAX, ChatMessageBody, StrictBody
from gateway.openai.fields import MESSAGE, Unserved, refuse_unserved
from gateway.openai.tools import chat_of
from gateway.text import tokenization
from gateway.text.chat import chat_chars, render_chat
from hetero.v1 import inference_pb2
from hetero_common.errors import ValidationError
from hetero_common.tokenizer import TextTokenizer

_CHAT_ONLY = ("messages", "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
              "tools", "mm_processor_kwargs")
_UNSERVED = {
    "continue_final_message": Unserved(lambda v: not v, "a final message is not continued"),
    "chat_template": Unserved(lambda v: v is None, "the model's own chat template is used"),
    "chat_template_kwargs": Unserved(lambda v: not v, "the chat template takes no extra arguments"),
    "mm_processor_kwargs": Unserved(lambda v: v is None, "only text is served"),
}


class TokenizeBody(StrictBody):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`), in one body."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="default: true for prompt, false for messages")
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered as for generation (tool_choice auto)
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _contract(self) -> "TokenizeBody":
        if (self.prompt is None) == (self.messages is None):
            raise ValidationError("send exactly one of prompt or messages", "prompt")
        sent = {k: getattr(self, k) for k in self.model_fields_set}
        if self.prompt is not None:
            chat_field = next((k for k in _CHAT_ONLY if k in sent), None)
            if chat_field is not None:
                raise ValidationError(f"{chat_field} goes with messages, not prompt", chat_field)
        refuse_unserved(sent, _UNSERVED)
        for i, m in enumerate(self.messages or []):
            refuse_unserved({k: getattr(m, k) for k in m.model_fields_set}, MESSAGE, f"messages[{i}].")
        return self


class DetokenizeBody(StrictBody):
    model: str | None = None
    tokens: list[int] = Field(description="token ids, each in [0, vocabulary size)")

    @model_validator(mode="after")
    def _range(self) -> "DetokenizeBody":
        bad = next((t for t in self.tokens if not 0 <= t <= UINT32_MAX), None)
        if bad is not None:
            raise ValidationError(f"tokens holds {bad}, which is not a token id", "tokens")
        return self


class TokenizerRoutes:
    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def tokenize(self, body: TokenizeBody) -> dict[str, Any]:
        """The answer's JSON is rendered with it, off the loop when large: a Response, which FastAPI sends as is."""
        g = self.generation
        await g.check_model(body.model or "")
        if body.messages is None:
            return await g.tokenizer_pool.run(_tokenize, g.tokenizer, body, None, g.max_model_len,
                                              chars=len(body.prompt or ""))
        if not g.tokenizer.chat_template:
            raise ValidationError("this model has no chat template; tokenize a plain `prompt` instead", "messages")
        # The chat as generation renders it: tools, calls and tool results (gateway/text/tool_calls.py).
        chat = chat_of(body.messages, body.tools, None)
        return await g.tokenizer_pool.run(_tokenize, g.tokenizer, body, chat, g.max_model_len, chars=chat_chars(chat))

    async def detokenize(self, body: DetokenizeBody) -> dict[str, str]:
        g = self.generation
        await g.check_model(body.model or "")
        return {"prompt": tokenization.detokenize(g.tokenizer, body.tokens)}

    async def tokenizer_info(self) -> dict[str, Any]:
        return tokenization.tokenizer_info(self.generation.tokenizer, self.generation.max_model_len)


def _tokenize(tokenizer: TextTokenizer, body: TokenizeBody, chat: inference_pb2.Chat | None,
              max_model_len: int) -> Any:
    """/tokenize's answer (on a tokenizer thread when the input is large: `TokenizerPool`)."""
    if chat is not None:
        ids = tokenizer.encode(render_chat(tokenizer, chat, body.add_generation_prompt),
                               add_special_tokens=bool(body.add_special_tokens))
    else:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenization.tokenize_text(tokenizer, body.prompt or "", add)
    answer = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
              "token_strs": tokenization.token_strings(tokenizer, ids) if body.return_token_strs else None}
    return Response(tokenization.json_bytes(answer), media_type="application/json")
