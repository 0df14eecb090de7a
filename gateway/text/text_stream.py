"""Token ids in, safe text out: incremental detokenization followed by stop-string matching."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stop_strings import StopStringMatcher
from hetero_common.sampling import Sampling
from hetero_common.tokenizer import TextTokenizer


@dataclass
class TextDelta:
    text: str
    stopped: bool = False  # a stop string matched: the request should end now
    stop_string: str | None = None
    used_tokens: int | None = None  # stopped: how many of the pushed tokens it took to complete the stop string


class TextStream:
    def __init__(self, tokenizer: TextTokenizer, prompt_token_ids: list[int], sampling: Sampling) -> None:
        self._detok = IncrementalDetokenizer(tokenizer.tokenizer, prompt_token_ids,
                                             skip_special_tokens=not sampling.include_special_tokens)
        self._stops = StopStringMatcher(sampling.stop)
        self._has_stops = bool(sampling.stop)
        self.stopped = False
        # min_tokens: stop strings are looked for only in the text after the first min_tokens tokens.
        self._unchecked_tokens = sampling.min_tokens if self._has_stops else 0

    def push_until_stop(self, token_ids: list[int]) -> TextDelta:
        """`push`, token by token where stop strings are set, so that a stop string completed by one of
        several tokens (a merged message) says which (`used_tokens`): the tokens after it are not the answer's."""
        if len(token_ids) < 2 or not self._has_stops:
            delta = self.push(token_ids)
            if delta.stopped:
                delta.used_tokens = len(token_ids)
            return delta
        texts = []
        for used, token_id in enumerate(token_ids, 1):
            delta = self.push([token_id])
            texts.append(delta.text)
            if delta.stopped:
                return TextDelta("".join(texts), True, delta.stop_string, used)
        return TextDelta("".join(texts))

    def push(self, token_ids: list[int]) -> TextDelta:
        if self.stopped:
            return TextDelta("", True)
        if self._unchecked_tokens:
            head, token_ids = token_ids[:self._unchecked_tokens], token_ids[self._unchecked_tokens:]
            self._unchecked_tokens -= len(head)
            unchecked = self._detok.push(head)
            if token_ids:
                return self._feed(self._detok.push(token_ids), unchecked)
            return TextDelta(unchecked)
        return self._feed(self._detok.push(token_ids))

    def _feed(self, text: str, unchecked: str = "") -> TextDelta:
        result = self._stops.feed(text)
        self.stopped = result.stopped
        return TextDelta(unchecked + result.text, result.stopped, result.matched)

    def finish(self) -> str:
        """End of generation: release text held back for a possible stop string or partial character."""
        if self.stopped:
            return ""
        if self._unchecked_tokens:  # ended within min_tokens (e.g. max_model_len): no stop string applies
            return self._detok.flush()
        result = self._stops.feed(self._detok.flush())
        if result.stopped:
            self.stopped = True
            return result.text
        return result.text + self._stops.flush()
