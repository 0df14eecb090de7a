"""The seed's own forms, without a model run: tokenizer.kind simple (the built-in byte-level
tokenizer), the seed's config.json and command-bridge config loading as written, and the
seed's command lines mapped onto the subcommands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hetero_common.simple_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, VOCAB_SIZE
from hetero_common.tokenizer import TokenizerError, load_tokenizer
from hetero_common.errors import ConfigError
from hetero_common.model_files import ModelFileError, default_model_path
from hetero_infer.cli import _parser, seed_form
from hetero_infer.config_sources import load_config
from tests.helpers.seed_forms import SEED_BRIDGE_CONFIG, SEED_CONFIG, write_config
from hetero_infer.bench.harness import REPO_ROOT
from tests.helpers.tiny_models import make_tiny_byte_llama


@pytest.fixture(scope="module")
def simple():
    return load_tokenizer(None, kind="simple")


@pytest.mark.parametrize("text", ["Hello, world!", "héllo wörld — 東京 🙂", "a\nb\tc\x00\x7f", "", " leading space"])
def test_simple_tokenizer_round_trips_any_text_byte_for_byte(simple, text: str) -> None:
    ids = simple.encode(text)
    assert ids == [BOS_TOKEN_ID, *text.encode("utf-8")]
    assert simple.decode(ids) == text
    assert simple.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))


def test_simple_tokenizer_special_ids(simple) -> None:
    assert (PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE) == (256, 257, 258, 259)
    assert simple.vocab_size == 259 and simple.bos_token_id == 257 and simple.eos_token_ids == (258,)
    assert simple.chat_template is None
    assert simple.decode([72, 258, 105, 256, 257]) == "Hi"  # special ids are dropped
    assert simple.decode([72, 258], skip_special_tokens=False) == "H<|simple_eos|>"
    # A prompt that spells a special token is still bytes: no client can inject EOS through text.
    assert simple.encode("<|simple_eos|>", add_special_tokens=False) == list(b"<|simple_eos|>")
    with pytest.raises(TokenizerError, match="no chat template"):
        simple.apply_chat_template([{"role": "user", "content": "hi"}])


def test_simple_tokenizer_refuses_another_models_vocabulary(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelFileError, match="tokenizer.kind simple .* vocabulary of 512: use tokenizer.kind auto"):
        load_tokenizer(tiny_llama_dir, kind="simple")
    with pytest.raises(ModelFileError, match="tokenizer.kind simple .* vocabulary of 49152: use tokenizer.kind auto"):
        load_tokenizer(default_model_path(), kind="simple")  # SmolLM2 (GGUF metadata only)


def test_simple_tokenizer_accepts_a_model_of_its_vocabulary(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(make_tiny_byte_llama(tmp_path / "byte-llama"), kind="simple")
    assert tokenizer.encode("ok") == [257, 111, 107]


def test_the_seed_config_json_loads_verbatim(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, SEED_CONFIG), env={})
    assert (config.block_size, config.max_num_blocks, config.max_batch_size, config.max_num_seqs) == (16, 1024, 32, 256)
    assert (config.max_model_len, config.max_total_tokens, config.memory_threshold) == (2048, 4096, 0.9)
    assert config.max_retry_attempts == 2
    assert (config.tokenizer.kind, config.tokenizer.path) == ("simple", None)
    assert (config.serving.host, config.serving.port, config.serving.model_name) == ("127.0.0.1", 3000, "hetero-infer")
    assert config.serving.backend.kind == "scheduler" and config.serving.backend.command is None  # local_engine


def test_the_seed_command_bridge_config_loads_with_the_simple_tokenizer(tmp_path: Path) -> None:
    data = {**SEED_BRIDGE_CONFIG, "tokenizer": {"kind": "simple", "path": None}}
    config = load_config(write_config(tmp_path, data), env={})
    assert config.serving.backend.kind == "command_bridge" and config.serving.backend.command.program == "/bin/sh"
    from gateway.server import load_gateway_tokenizer

    assert load_gateway_tokenizer(config).vocab_size == VOCAB_SIZE  # no model checked: the bridge serves none


def test_simple_tokenizer_takes_no_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer.path"):
        load_config(write_config(tmp_path, {"tokenizer": {"kind": "simple", "path": "tokenizer.json"}}), env={})


@pytest.mark.parametrize("argv, command", [
    (["--input", "Hello, world!", "--max-tokens", "50"], "generate"),
    (["--input", "Explain quantum computing", "--max-tokens", "100", "--temperature", "0.8", "--top-p", "0.95"], "generate"),
    (["--config", "config.json", "--input", "Hello"], "generate"),
    (["--serve"], "serve"),
    (["--serve", "--config", "config.json"], "serve"),
    (["generate", "--input", "x"], "generate"),
    (["serve"], "serve"),
])
def test_the_seed_command_lines_parse(argv: list[str], command: str) -> None:
    args = _parser().parse_args(seed_form(argv))
    assert args.command == command
    if "--temperature" in argv:
        assert (args.input, args.max_tokens, args.temperature, args.top_p) == ("Explain quantum computing", 100, 0.8, 0.95)


def test_the_seed_config_with_the_default_model_fails_naming_tokenizer_kind(tmp_path: Path) -> None:
    """SmolLM2's vocabulary is not the simple tokenizer's: refused before the model loads."""
    write_config(tmp_path, SEED_CONFIG)
    result = subprocess.run([sys.executable, "-m", "hetero_infer.cli", "--config", "config.json", "--input", "Hello"],
                            cwd=tmp_path, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "tokenizer.kind simple" in result.stderr and "use tokenizer.kind auto" in result.stderr
