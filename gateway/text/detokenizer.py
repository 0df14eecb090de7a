"""Incremental (streaming) detokenization.

Decoding token by token in isolation is wrong in two ways: byte-level BPE splits a UTF-8
character over several tokens (a lone piece decodes to U+FFFD), and SentencePiece-style
decoders drop the leading space of the first token they see. So we decode a small sliding
window of tokens with some left context and emit only the text the newest tokens add:

    ids[prefix_offset:read_offset]   already emitted; decoded only as left context
    ids[read_offset:]                pending; emitted once their text does not end in U+FFFD

Each step decodes O(window) tokens, never the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

REPLACEMENT_CHAR = "\ufffd"
# Left context taken from the prompt tail; enough to restore a leading space or a merge.
PROMPT_CONTEXT_TOKENS = 5
# An incomplete UTF-8 character is at most 3 bytes, and every non-special token carries at
# least one byte, so it spans at most the last 3 pending tokens. Anything held longer than
# that which still ends in U+FFFD holds genuine replacement characters (invalid bytes, or
# U+FFFD in the text itself): release all but the last few tokens so a stream of garbage
# bytes keeps flowing and the window stays bounded.
_MAX_PARTIAL_TOKENS = 3


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Skipped special tokens decode to nothing in any context, so dropping them up front
        # is exact and keeps them from growing the window.
        self._special_ids: frozenset[int] = (
            frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
            if skip_special_tokens
            else frozenset()
        )
        prompt = self._filter(prompt_token_ids)
        context = prompt[max(0, len(prompt) - PROMPT_CONTEXT_TOKENS) :]
        # Only the window is kept; offsets are relative to it.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the new text they complete (possibly "")."""
        out: list[str] = []
        # One token at a time keeps each decode O(window) and emits complete characters as
        # early as possible even when a chunk ends mid-character.
        for token_id in self._filter(token_ids):
            self._ids.append(token_id)
            out.append(self._step(final=False))
        return self._record("".join(out))

    def flush(self) -> str:
        """End of stream: release held-back tokens, U+FFFD for a trailing partial char included."""
        return self._record(self._step(final=True))

    def _filter(self, token_ids: Sequence[int]) -> list[int]:
        return [i for i in token_ids if i not in self._special_ids]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _step(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(REPLACEMENT_CHAR)):
            return self._advance(new_text[len(prefix_text) :], len(self._ids))
        if not final and len(self._ids) - self._read_offset > _MAX_PARTIAL_TOKENS:
            split = len(self._ids) - _MAX_PARTIAL_TOKENS
            head = self._decode(self._ids[self._prefix_offset : split])
            # startswith: the released tokens must decode the same with the held ones after them.
            if len(head) > len(prefix_text) and new_text.startswith(head):
                return self._advance(head[len(prefix_text) :], split)
        return ""

    def _advance(self, emitted: str, new_read_offset: int) -> str:
        # The just-emitted tokens become the next window's left context; older ones go.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, new_read_offset - self._read_offset
        return emitted

    def _record(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece
