"""How many characters of text one token can stand for, at most: a text longer than
`max_model_len` times that many characters cannot fit the context, so the gateway refuses it
before tokenizing it (tokenizing megabytes takes seconds and gigabytes).

The bound must hold for every text, so it is only given for tokenizers whose pipeline never
makes text shorter nor drops any of it:
- normalizers that keep or grow the text (none, NFD, NFKD, Lowercase, Prepend, Replace of a
  string by one at least as long); NFC/NFKC compose, Strip and the BERT and SentencePiece
  (Precompiled) normalizers can remove characters, so they give no bound;
- pre-tokenizers that keep every character (ByteLevel, Digits, Metaspace, Punctuation,
  UnicodeScripts, Split but not with behavior Removed); Whitespace and BERT's drop spaces;
- a BPE model that has a token for every piece: byte_fallback, or an unknown token that is
  not fused (one per unknown character), or byte-level with the symbol of every continuation
  byte; a one-byte character whose symbol is missing is dropped, and is not counted (SmolLM2's
  vocabulary lacks six ASCII control characters);
- no added token that swallows the spaces around it (lstrip/rstrip), and no truncation.
Then each token stands for at most its vocabulary string's length in characters: a byte-level
string has one character per byte (and a character is at least one byte), a SentencePiece
string one per normalized character, a byte-fallback token `<0xNN>` one byte in six characters.
Special tokens count only where the text can spell them (not with `encode_special_tokens`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import tokenizers

from hetero_common.simple_tokenizer import byte_symbols

_GROWING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Metaspace", "UnicodeScripts"}
_SPLITTING_PRE_TOKENIZERS = {"Split", "Punctuation"}  # keep everything unless behavior is Removed
_BYTE_SYMBOLS = byte_symbols()


def _normalizer_keeps_text(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_normalizer_keeps_text(n) for n in spec.get("normalizers", []))
    if kind == "Replace":
        pattern = spec.get("pattern", {})
        return "String" in pattern and len(spec.get("content", "")) >= len(pattern["String"]) > 0
    return kind in _GROWING_NORMALIZERS


def _pre_tokenizer_keeps_text(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(p) for p in spec.get("pretokenizers", []))
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _byte_level(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return False
    if spec.get("type") == "Sequence":
        return any(_byte_level(p) for p in spec.get("pretokenizers", []))
    return spec.get("type") == "ByteLevel"


def _dropped_characters(model: dict[str, Any], byte_level: bool, vocab: dict[str, int]) -> str | None:
    """The characters this model drops (no token stands for them), or None when it may drop others
    too, or a character's tokens may stand for more than its characters."""
    if model.get("type") != "BPE":
        return None  # WordPiece, WordLevel and Unigram can stand one unknown token for a whole word
    if model.get("byte_fallback") or (model.get("unk_token") is not None and not model.get("fuse_unk")):
        return ""  # every byte has a token, or each unknown character its own
    if not byte_level:
        return None  # an unknown character is dropped, whichever it is
    # A byte-level BPE without a byte's symbol drops that byte. A character of several bytes keeps
    # at least one while every continuation byte (0x80-0xBF) has its symbol; a one-byte character
    # without its symbol is dropped whole: those are not counted.
    missing = [b for b, symbol in enumerate(_BYTE_SYMBOLS) if symbol not in vocab]
    if any(0x80 <= b <= 0xBF for b in missing):
        return None
    return "".join(chr(b) for b in missing if b < 0x80)


@dataclass(frozen=True)
class TokenBound:
    """Each counted character of a text needs at least 1 / `max_chars` of a token."""

    max_chars: int  # the most counted characters one token stands for
    uncounted: str  # characters the tokenizer drops: they need no token

    def chars(self, text: str) -> int:
        """The characters of `text` that need tokens (one pass over the text per uncounted character)."""
        return len(text) - sum(text.count(c) for c in self.uncounted)

    def min_tokens(self, chars: int) -> int:
        """The fewest tokens that `chars` counted characters can make (at least one per `max_chars`)."""
        return -(-chars // self.max_chars)


def token_bound(tokenizer: tokenizers.Tokenizer) -> TokenBound | None:
    """The bound of this tokenizer; None when it may drop or shrink text so that none holds (module docstring)."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("truncation") is not None or not _normalizer_keeps_text(spec.get("normalizer")):
        return None
    if not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    model = spec.get("model") or {}
    vocab: dict[str, int] = model.get("vocab") or {}
    dropped = _dropped_characters(model, _byte_level(spec.get("pre_tokenizer")), vocab)
    if dropped is None:
        return None
    # Added tokens are matched in the text as written; special ones not at all with encode_special_tokens.
    literal = not getattr(tokenizer, "encode_special_tokens", False)
    spelled = [t["content"] for t in added if literal or not t.get("special")]
    longest = max(map(len, [*vocab, *spelled]), default=0)
    return TokenBound(longest, dropped) if longest else None
