"""`tokenizer.kind: simple`: the seed's built-in SimpleTokenizer, byte-level.

Layout (259 ids): ids 0-255 are the UTF-8 bytes 0x00-0xFF, so any text round-trips exactly;
then the special ids PAD 256, BOS 257, EOS 258. `encode` puts BOS first (the seed's tokenizer
also appended EOS to every text; a prompt must not end with EOS, so it is left off here).
`decode` drops the special ids. There is no chat template: send plain prompts.

It is a real `tokenizers.Tokenizer` (a BPE with the 256 byte symbols and no merges, behind
the GPT-2 byte-level pre-tokenizer and decoder), so the gateway uses it through the same
`TextTokenizer` interface as every other tokenizer. It serves the command bridge (whose
program answers in text) and models whose vocabulary it matches: a model of any other
vocabulary size is refused at start (`check_model_vocabulary`), naming tokenizer.kind.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from hetero_common.model_files import ModelFileError, read_gguf_metadata, read_json

NUM_BYTES = 256
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 256, 257, 258
SPECIAL_TOKENS = {PAD_TOKEN_ID: "<|simple_pad|>", BOS_TOKEN_ID: "<|simple_bos|>", EOS_TOKEN_ID: "<|simple_eos|>"}
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value (what the byte-level pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for b in range(NUM_BYTES):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(NUM_BYTES + extra)
            extra += 1
    return [symbols[b] for b in range(NUM_BYTES)]


@lru_cache(maxsize=1)
def simple_tokenizer_model() -> tokenizers.Tokenizer:
    vocab = {symbol: b for b, symbol in enumerate(byte_symbols())}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Added in id order, so they take 256, 257, 258.
    tokenizer.add_special_tokens([AddedToken(SPECIAL_TOKENS[i], special=True, normalized=False)
                                  for i in sorted(SPECIAL_TOKENS)])
    assert [tokenizer.token_to_id(SPECIAL_TOKENS[i]) for i in sorted(SPECIAL_TOKENS)] == sorted(SPECIAL_TOKENS)
    tokenizer.encode_special_tokens = True  # text is always bytes: "<|simple_eos|>" in a prompt is 14 bytes, not EOS
    return tokenizer


def model_vocabulary_size(model_path: Path) -> int | None:
    """The model's vocabulary size from its config.json (HF directory) or GGUF metadata; None if unknown."""
    if model_path.is_dir():
        size = read_json(model_path / "config.json", missing_ok=True).get("vocab_size")
        return int(size) if size is not None else None
    if model_path.suffix.lower() == ".gguf" and model_path.is_file():
        meta = read_gguf_metadata(model_path)
        arch = meta.get("general.architecture", "llama")
        size = meta.get(f"{arch}.vocab_size")
        return int(size) if size is not None else len(meta.get("tokenizer.ggml.tokens", [])) or None
    return None


def check_model_vocabulary(model_path: Path) -> None:
    """Refuse a model whose vocabulary is not the simple tokenizer's (its ids would mean other tokens)."""
    size = model_vocabulary_size(model_path)
    if size != VOCAB_SIZE:
        raise ModelFileError(
            f"tokenizer.kind simple is a byte-level tokenizer of {VOCAB_SIZE} ids (bytes 0-255, PAD {PAD_TOKEN_ID}, "
            f"BOS {BOS_TOKEN_ID}, EOS {EOS_TOKEN_ID}); model {str(model_path)!r} has a vocabulary of "
            f"{size if size is not None else 'unknown size'}: use tokenizer.kind auto (the model's own tokenizer)")
