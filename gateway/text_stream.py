"""Token ids in, safe text out: incremental detokenization followed by stop-string matching."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopStringMatcher
from gateway.tokenizer import TextTokenizer
from hetero_common.sampling import Sampling


@dataclass
class TextDelta:
    text: str
    stopped: bool = False  # a stop string matched: the request should end now
    stop_string: str | None = None


class TextStream:
    def __init__(self, tokenizer: TextTokenizer, prompt_token_ids: list[int], sampling: Sampling) -> None:
        self._detok = IncrementalDetokenizer(tokenizer.tokenizer, prompt_token_ids,
                                             skip_special_tokens=not sampling.include_special_tokens)
        self._stops = StopStringMatcher(sampling.stop)
        self.stopped = False

    def push(self, token_ids: list[int]) -> TextDelta:
        if self.stopped:
            return TextDelta("", True)
        result = self._stops.feed(self._detok.push(token_ids))
        self.stopped = result.stopped
        return TextDelta(result.text, result.stopped, result.matched)

    def finish(self) -> str:
        """End of generation: release text held back for a possible stop string or partial character."""
        if self.stopped:
            return ""
        result = self._stops.feed(self._detok.flush())
        if result.stopped:
            self.stopped = True
            return result.text
        return result.text + self._stops.flush()
