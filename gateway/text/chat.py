"""A chat as text: rendered through the model's chat template with its tools and tool calls, and what
rendering it costs (its characters), read before it is rendered."""

from __future__ import annotations

from gateway.text.tool_calls import template_input
from hetero.v1 import inference_pb2
from hetero_common.errors import ValidationError
from hetero_common.tokenizer import TextTokenizer


def render_chat(tokenizer: TextTokenizer, chat: inference_pb2.Chat, add_generation_prompt: bool = True) -> str:
    """The chat as the model's template writes it, with its tools and tool calls (`tool_calls.py`)."""
    if not tokenizer.chat_template:
        raise ValidationError("this model has no chat template; send `prompt` (plain text) instead of `chat`")
    messages, tools = template_input(chat, tokenizer)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)


def chat_chars(chat: inference_pb2.Chat) -> int:
    """The characters of a chat's messages, calls and tools: what rendering and tokenizing it costs."""
    return (sum(len(m.content) + len(m.name) + sum(len(c.arguments) for c in m.tool_calls) for m in chat.messages)
            + sum(len(t.parameters_json) + len(t.description) for t in chat.tools))
