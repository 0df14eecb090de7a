"""IncrementalDetokenizer against real `tokenizers` tokenizers of the three decoder families:
trained byte-level BPE (GPT-2/SmolLM2), byte-level BPE with no merges (every multi-byte char
is split over several tokens), and Llama-style SentencePiece BPE (metaspace + byte fallback)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gateway.text.detokenizer import IncrementalDetokenizer
from hetero_infer.bench.harness import CORPUS, SPECIAL_TOKENS, make_tokenizer

FFFD = "\ufffd"


def _tiny_trained(directory: Path) -> Tokenizer:
    make_tokenizer(directory)
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def _byte_only() -> Tokenizer:
    """The 256 byte tokens and no merges: é is 2 tokens, 東 3, 🙂 4."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def _llama_style() -> Tokenizer:
    """SentencePiece-style BPE: `▁` for spaces, <0xNN> byte fallback for unseen chars, and a
    decoder that strips the leading space of whatever it decodes."""
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIAL_TOKENS], show_progress=False)
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    ascii_corpus = [line for line in CORPUS if line.isascii()]  # é, 東, 🙂 must fall back to bytes
    base.train_from_iterator(ascii_corpus * 4, trainer=trainer)
    vocab = base.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) for m in json.loads(base.to_str())["model"]["merges"]]  # [[a, b], ...]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", *SPECIAL_TOKENS])
    return tok


@pytest.fixture(scope="module")
def tokenizers_by_name(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    return {
        "trained": _tiny_trained(tmp_path_factory.mktemp("tok")),
        "byte_only": _byte_only(),
        "llama": _llama_style(),
    }


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunks: Sequence[int]) -> list[str]:
    pieces, i = [], 0
    for size in chunks:
        if i >= len(ids):
            break
        pieces.append(detok.push(ids[i : i + size]))
        i += size
    pieces.append(detok.push(ids[i:]))
    pieces.append(detok.flush())
    return pieces


def test_byte_only_really_splits_characters(tokenizers_by_name: dict[str, Tokenizer]) -> None:
    tok = tokenizers_by_name["byte_only"]
    assert [len(tok.encode(c).ids) for c in "é東🙂"] == [2, 3, 4]
    assert FFFD in tok.decode(tok.encode("東").ids[:2])


@pytest.mark.parametrize("name", ["trained", "byte_only", "llama"])
def test_multibyte_chars_are_held_until_complete(tokenizers_by_name: dict[str, Tokenizer], name: str) -> None:
    tok = tokenizers_by_name[name]
    text = "héllo 東京 🙂 café"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert all(FFFD not in p for p in pieces)
    assert "".join(pieces) == detok.text == tok.decode(ids)
    if name == "byte_only":
        # Each character appears exactly when its last byte arrives.
        assert [p for p in pieces if p] == list(text)


def test_flush_releases_a_trailing_partial_character(tokenizers_by_name: dict[str, Tokenizer]) -> None:
    tok = tokenizers_by_name["byte_only"]
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.encode("a東").ids[:3]) == "a"
    assert detok.flush() == FFFD
    assert detok.text == "a" + FFFD


def test_special_tokens(tokenizers_by_name: dict[str, Tokenizer]) -> None:
    tok = tokenizers_by_name["trained"]
    end = tok.token_to_id("<|im_end|>")
    ids = [*tok.encode("Paris").ids, end, *tok.encode(" is").ids]
    skipped = IncrementalDetokenizer(tok)
    assert "".join(skipped.push([i]) for i in ids) + skipped.flush() == "Paris is"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(kept.push([i]) for i in ids) + kept.flush() == "Paris<|im_end|> is"


def test_prompt_context_keeps_the_leading_space(tokenizers_by_name: dict[str, Tokenizer]) -> None:
    tok = tokenizers_by_name["llama"]
    ids = tok.encode("The quick brown fox").ids
    n_prompt = len(tok.encode("The quick").ids)
    prompt, generated = ids[:n_prompt], ids[n_prompt:]
    assert tok.decode(generated) == "brown fox"  # decoded alone, the space is lost
    with_context = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    assert "".join(with_context.push([i]) for i in generated) + with_context.flush() == " brown fox"
    assert tok.decode(prompt) + with_context.text == tok.decode(ids)
    # Without a prompt the stream matches decode(generated): the first space is dropped there too.
    alone = IncrementalDetokenizer(tok)
    assert "".join(alone.push([i]) for i in generated) + alone.flush() == "brown fox"


def test_invalid_bytes_keep_flowing_and_window_stays_small(tokenizers_by_name: dict[str, Tokenizer]) -> None:
    tok = tokenizers_by_name["byte_only"]
    stray = tok.encode("é").ids[1]  # a lone continuation byte: always U+FFFD, never completes
    decoded_lengths: list[int] = []

    class CountingTokenizer:
        def get_added_tokens_decoder(self) -> dict:
            return tok.get_added_tokens_decoder()

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            decoded_lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    detok = IncrementalDetokenizer(CountingTokenizer(), prompt_token_ids=tok.encode("prompt " * 50).ids)  # type: ignore[arg-type]
    ids = [stray] * 200 + tok.encode("ok 東京").ids * 100
    streamed = "".join(detok.push([i]) for i in ids[:200])
    assert len(streamed) >= 190  # released before the end of the stream
    streamed += "".join(detok.push([i]) for i in ids[200:]) + detok.flush()
    assert streamed == tok.decode(ids)
    assert max(decoded_lengths) <= 16


TEXT = st.text(
    alphabet=st.one_of(st.characters(exclude_categories=["Cs"]), st.sampled_from("é東京🙂 \n.aZ")),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(["trained", "byte_only", "llama"]),
    text=TEXT,
    chunks=st.lists(st.integers(min_value=1, max_value=6), max_size=40),
    prompt=st.sampled_from(["", "The quick", "東", "<|im_start|>assistant\n"]),
)
def test_streaming_equals_full_decode(
    tokenizers_by_name: dict[str, Tokenizer], name: str, text: str, chunks: list[int], prompt: str
) -> None:
    tok = tokenizers_by_name[name]
    ids = tok.encode(text).ids
    prompt_ids = tok.encode(prompt).ids
    expected = tok.decode(ids)
    if name == "llama" and prompt_ids:
        # With left context the leading space that decode(ids) strips is (correctly) kept.
        expected = tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)) :]
    for sizes in ([1] * len(ids), chunks):
        detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt_ids)
        pieces = _stream(detok, ids, sizes)
        assert "".join(pieces) == detok.text == expected
        if FFFD not in text:
            assert all(FFFD not in p for p in pieces)
