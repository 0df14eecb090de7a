"""The characters-per-token bound (hetero_common/token_bound.py) is an upper bound for real
tokenizers: no text makes fewer tokens than its counted characters divided by it. Checked on
random and adversarial texts with SmolLM2's tokenizer (the default model's GGUF), the tiny
test tokenizer and the built-in byte-level one; and withheld for pipelines that drop text."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from hetero_common.model_files import default_model_path
from hetero_common.token_bound import token_bound
from hetero_common.tokenizer import TextTokenizer, load_tokenizer
from hetero_infer.bench.harness import make_tokenizer


@pytest.fixture(scope="module")
def tokenizers_under_test(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TextTokenizer]:
    tiny = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tokenizer(tiny)
    return {"smollm2": load_tokenizer(default_model_path()), "tiny": load_tokenizer(tiny),
            "simple": load_tokenizer(None, kind="simple")}


def texts(tokenizer: TextTokenizer, seed: int) -> list[str]:
    """Random and adversarial texts: the longest token repeated, special-token spellings, the
    characters the vocabulary lacks, long runs, mixed scripts and emoji."""
    rng = random.Random(seed)
    vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    longest = max(vocab, key=len)
    decoded_longest = tokenizer.decode([vocab[longest]], skip_special_tokens=False)
    alphabet = "abc XYZ\n\t  éü中文😀\x1d\x04#=-" + decoded_longest
    out = [decoded_longest * 50, "<|im_start|>" * 40, "\x1d" * 500 + "a", " " * 2000, "=" * 3000, "😀" * 300]
    for _ in range(60):
        out.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))))
        out.append(" ".join(rng.choice(list(vocab)) for _ in range(rng.randint(1, 300))))
    return out


@pytest.mark.parametrize("name", ["smollm2", "tiny", "simple"])
def test_the_bound_holds_for_every_text(tokenizers_under_test: dict[str, TextTokenizer], name: str) -> None:
    tokenizer = tokenizers_under_test[name]
    bound = tokenizer.bound
    assert bound is not None
    for text in texts(tokenizer, seed=len(name)):
        for add_special_tokens in (True, False):
            tokens = len(tokenizer.encode(text, add_special_tokens=add_special_tokens))
            assert bound.min_tokens(bound.chars(text)) <= tokens, (name, text[:80], tokens)


def test_the_bound_of_known_tokenizers(tokenizers_under_test: dict[str, TextTokenizer]) -> None:
    smollm2 = tokenizers_under_test["smollm2"].bound
    assert smollm2 is not None and smollm2.max_chars == 81  # "\n" and 80 spaces
    assert smollm2.uncounted == "\x04\x06\x13\x14\x16\x1d"  # ASCII controls its vocabulary lacks: dropped
    assert tokenizers_under_test["simple"].bound.max_chars == 1  # type: ignore[union-attr]  # one byte per token


def _bpe(normalizer: normalizers.Normalizer | None = None, pre: pre_tokenizers.PreTokenizer | None = None,
         unk: str | None = "?") -> Tokenizer:
    vocab = {"?": 0, "a": 1, "b": 2, "ab": 3, " ": 4}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token=unk))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre is not None:
        tokenizer.pre_tokenizer = pre
    return tokenizer


def test_no_bound_where_the_pipeline_drops_or_shrinks_text() -> None:
    assert token_bound(_bpe()).max_chars == 2  # type: ignore[union-attr]
    assert token_bound(_bpe(normalizers.Lowercase())) is not None
    assert token_bound(_bpe(normalizers.NFC())) is None  # composes characters
    assert token_bound(_bpe(normalizers.Strip())) is None
    assert token_bound(_bpe(pre=pre_tokenizers.Whitespace())) is None  # drops spaces
    assert token_bound(_bpe(unk=None)) is None  # drops unknown characters
    swallowing = _bpe()
    swallowing.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert token_bound(swallowing) is None  # "<mask>" takes the spaces before it
    truncating = _bpe()
    truncating.enable_truncation(8)
    assert token_bound(truncating) is None
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert token_bound(wordpiece) is None  # one [UNK] for a whole word


def test_a_tokenizer_file_without_a_bound_loads(tmp_path: Path) -> None:
    tokenizer = _bpe(pre=pre_tokenizers.Whitespace())
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).bound is None
