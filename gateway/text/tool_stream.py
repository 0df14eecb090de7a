"""A sample's text, with its tool calls taken out (`ToolPlan.parse`), as it streams.

Text that may be a call is held back rather than sent as content: in the constrained modes
(`required`, a named tool) all of it; with `auto`, everything from where a `<tool_call>` tag
may begin, or the whole answer when it opens with `{` or `[` (a bare JSON call). When the
sample ends, the held text is parsed: calls go on the last message (`tool_calls`, finish
reason TOOL_CALLS) and text that holds no call is released as content after all.
"""

from __future__ import annotations

import json

from gateway.text.tool_calls import CALL_OPEN, ToolPlan
from hetero.v1 import common_pb2, inference_pb2
from hetero_common.errors import ValidationError
from hetero_common.finish_reasons import is_finished

# A sample that ended this way may hold a call; an aborted or failed one is left as it is.
_CALL_ENDINGS = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


def _partial_open_at(text: str) -> int:
    """Where a prefix of CALL_OPEN starts at the end of `text` (len(text) when none)."""
    for size in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return len(text) - size
    return len(text)


class ToolCallStream:
    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.sent = ""  # released as content
        self.held = ""  # may be (part of) a call
        self.holding = plan.constrained  # from here on everything is held until the end

    def push(self, text: str) -> str:
        """The part of `text` that is content for sure."""
        if self.holding:
            self.held += text
            return ""
        pending = self.held + text
        if not self.sent and not pending.strip():  # leading whitespace waits for what follows it
            self.held = pending
            return ""
        if not self.sent and pending.lstrip()[:1] in ("{", "["):
            self.holding, self.held = True, pending
            return ""
        start = pending.find(CALL_OPEN)
        if start >= 0:
            self.holding = True
        else:
            start = _partial_open_at(pending)
        release, self.held = pending[:start], pending[start:]
        self.sent += release
        return release

    def apply(self, response: inference_pb2.GenerateResponse) -> None:
        """Filter one message of the sample in place; on its last, parse what was held."""
        response.text = self.push(response.text)
        if not is_finished(response.finish_reason):
            return
        parsed = self.plan.parse(self.sent + self.held) if response.finish_reason in _CALL_ENDINGS else None
        if parsed is None:
            response.text += self.held  # no call: the held text was content after all
            self.sent += self.held
        else:
            full = self.sent + self.held
            start = full.find(CALL_OPEN)
            response.text += full[len(self.sent):start].rstrip() if start > len(self.sent) else ""
            response.tool_calls.extend(parsed.calls)
            response.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
        self.held = ""


def tool_request(request: inference_pb2.GenerateRequest) -> tuple[inference_pb2.GenerateRequest, ToolPlan | None]:
    """The request as the engine runs it, and its tool plan (None when no call can come back).
    `required` and a named tool add the call's JSON Schema as the request's constraint."""
    if request.WhichOneof("input") != "chat":
        return request, None
    plan = ToolPlan.of(request.chat)
    if not plan.active:
        return request, None
    kind = request.params.WhichOneof("constraint")
    if kind is not None:
        param = "tool_choice" if plan.constrained else "tools"
        raise ValidationError(f"{param}: params.{kind} (structured output) cannot be combined with tools unless "
                              "chat.tool_choice is none (required and a named tool constrain the output themselves)",
                              param)
    schema = plan.constraint_schema()
    if schema is not None:
        engine = inference_pb2.GenerateRequest()
        engine.CopyFrom(request)
        engine.params.json_schema = json.dumps(schema)
        request = engine
    return request, plan
