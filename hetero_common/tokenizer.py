"""The served model's text tokenizer: a `tokenizers.Tokenizer` plus the model's special ids and chat template.
The gateway tokenizes and renders chats with it; a worker loads the same one for constrained decoding.

Built from a Hugging Face directory (tokenizer.json and its config files) or from a GGUF file's
metadata alone. The GGUF path never touches the weights: a small header parser reads just the
key/value section, because `gguf.GGUFReader` also maps every tensor and turns each of the ~100k
vocabulary strings into numpy views, which costs seconds for a metadata-only job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from hetero_common.simple_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, check_model_vocabulary, simple_tokenizer_model
from hetero_common.errors import ValidationError
from hetero_common.token_bound import TokenBound, token_bound
from hetero_common.model_files import ModelFileError, read_gguf_metadata, read_json, token_ids


class TokenizerError(ModelFileError):
    """A tokenizer cannot be loaded or used; the message says what to fix."""


class ChatTemplateRejected(ValidationError, ValueError):
    """The chat template refused these messages (its raise_exception): a bad request, not a bad model."""


@dataclass
class TextTokenizer:
    tokenizer: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    add_bos_token: bool
    # tokenizer_config.json (or what GGUF metadata says of the same): read by /tokenizer_info.
    config: dict[str, Any] = field(default_factory=dict)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call releases the GIL while it tokenizes (`encode` holds it throughout), so a
        # large text tokenized on a worker thread leaves the gateway's event loop running; `_fast`
        # skips the character offsets, which nothing here reads.
        ids = self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        # A tokenizer.json post-processor (or a chat template rendering the BOS text) may already
        # have put BOS first; never add a second one.
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int | None) -> str:
        """The literal text of one token ("" for None or an unknown id), for template variables."""
        return (self.tokenizer.id_to_token(token_id) or "") if token_id is not None else ""

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (the Hugging Face convention for
        templates that render tool definitions and calls themselves)."""
        return bool(self.chat_template) and "tools" in _template_variables(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render `messages` into a prompt string, as `transformers`' apply_chat_template(tokenize=False)."""
        if not self.chat_template:
            raise TokenizerError(
                "This model's tokenizer has no chat template: send a plain text prompt, or supply a "
                "tokenizer_config.json (or chat_template.jinja) that defines `chat_template`."
            )
        from jinja2.exceptions import TemplateError

        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        try:
            return _compile_template(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.token_text(self.bos_token_id),
                eos_token=self.token_text(eos),
                tools=tools,
            )
        except TemplateError as exc:  # includes the template's own raise_exception("..."): a bad request
            raise ChatTemplateRejected(f"messages: the chat template rejected these messages: {exc}", "messages") from exc

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def bound(self) -> TokenBound | None:
        """How many characters one token stands for at most (`token_bound.py`); None: no such bound."""
        return token_bound(self.tokenizer)

    @cached_property
    def guidance(self) -> Any:
        """llguidance's tokenizer of this vocabulary (constraint validation), built at the first use."""
        from hetero_common.constraints import build_ll_tokenizer

        try:
            return build_ll_tokenizer(self.tokenizer.to_str(), list(self.eos_token_ids))
        except ValueError as exc:
            raise ValidationError(f"constrained decoding is not available with this tokenizer: {exc}") from exc


TOKENIZER_KINDS = ("auto", "huggingface", "gguf", "simple")  # the values of the config key tokenizer.kind


def load_tokenizer(model_path: str | Path | None, tokenizer_path: str | Path | None = None, *,
                   kind: str = "auto") -> TextTokenizer:
    """The tokenizer for a model: from `tokenizer_path` when given (a tokenizer.json, a directory
    holding one, or a .gguf file), else from `model_path` (a HF directory or a .gguf file).

    `kind` is the format the source must have: "huggingface" loads only a tokenizer.json, "gguf"
    only a GGUF file's tokenizer (whatever the file is called), "auto" goes by the .gguf suffix;
    "simple" is the built-in byte-level tokenizer (simple_tokenizer.py), checked against the
    model's vocabulary (`model_path` None: no model, as for the command bridge)."""
    if kind not in TOKENIZER_KINDS:
        raise TokenizerError(f"Unknown tokenizer kind {kind!r}: use one of {', '.join(TOKENIZER_KINDS)}.")
    if kind == "simple":
        if model_path is not None:
            check_model_vocabulary(Path(model_path))
        return TextTokenizer(simple_tokenizer_model(), bos_token_id=BOS_TOKEN_ID, eos_token_ids=(EOS_TOKEN_ID,),
                             chat_template=None, add_bos_token=True)
    if model_path is None and tokenizer_path is None:
        raise TokenizerError(f"tokenizer.kind {kind} needs a model or tokenizer.path to load the tokenizer from")
    model_path = Path(model_path if model_path is not None else tokenizer_path)  # type: ignore[arg-type]
    source = Path(tokenizer_path) if tokenizer_path is not None else model_path
    if not source.exists():
        raise TokenizerError(f"Tokenizer source {str(source)!r} does not exist: pass a model directory or .gguf file.")
    named_gguf = source.is_file() and source.suffix.lower() == ".gguf"
    if kind == "gguf" and not source.is_file():
        raise TokenizerError(f"tokenizer.kind is gguf but {str(source)!r} is a directory: point tokenizer.path "
                             "at the .gguf file, or set tokenizer.kind to auto or huggingface.")
    if kind == "huggingface" and named_gguf:
        raise TokenizerError(f"tokenizer.kind is huggingface but {str(source)!r} is a GGUF file: point "
                             "tokenizer.path at a tokenizer.json, or set tokenizer.kind to auto or gguf.")
    if kind == "gguf" or named_gguf:
        return _from_gguf(source)
    tokenizer_file = source / "tokenizer.json" if source.is_dir() else source
    if not tokenizer_file.is_file():
        raise TokenizerError(
            f"No tokenizer.json at {str(tokenizer_file)!r}: point tokenizer_path at a tokenizer.json "
            "or use a model directory that contains one."
        )
    # Side files live next to the tokenizer; config.json/generation_config.json next to the weights.
    model_dir = model_path if model_path.is_dir() else tokenizer_file.parent
    side_dirs = list(dict.fromkeys([tokenizer_file.parent, model_dir]))
    return _from_hf(tokenizer_file, side_dirs)


# --- Hugging Face tokenizer.json --------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as serialized AddedToken dicts."""
    return value.get("content") if isinstance(value, dict) else value


def _hf_chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"  # where transformers >= 4.50 saves it
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if template is None:
        template = read_json(directory / "chat_template.json", missing_ok=True).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _from_hf(tokenizer_file: Path, side_dirs: list[Path]) -> TextTokenizer:
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises a bare Exception for malformed files
        raise TokenizerError(f"Cannot parse {str(tokenizer_file)!r} as a tokenizers JSON file: {exc}.") from exc
    tokenizer_config: dict[str, Any] = {}
    for directory in reversed(side_dirs):  # the tokenizer's own directory wins
        tokenizer_config.update(read_json(directory / "tokenizer_config.json", missing_ok=True))
    chat_template = next((t for d in side_dirs if (t := _hf_chat_template(d, tokenizer_config))), None)

    def token_id(value: Any) -> int | None:
        content = _token_content(value)
        return tokenizer.token_to_id(content) if content else None

    bos = token_id(tokenizer_config.get("bos_token"))
    eos = [i for i in [token_id(tokenizer_config.get("eos_token"))] if i is not None]
    for directory in side_dirs:
        config = read_json(directory / "config.json", missing_ok=True)
        bos = bos if bos is not None else (None if config.get("bos_token_id") is None else int(config["bos_token_id"]))
        generation = read_json(directory / "generation_config.json", missing_ok=True)
        eos += token_ids(config.get("eos_token_id")) + token_ids(generation.get("eos_token_id"))
    return TextTokenizer(
        tokenizer=tokenizer,
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        chat_template=chat_template,
        add_bos_token=bool(tokenizer_config.get("add_bos_token", False)),
        config=tokenizer_config,
    )


# --- GGUF metadata ------------------------------------------------------------------------------

# Pre-tokenizer splits by `tokenizer.ggml.pre`, matching the Hugging Face tokenizer.json of those
# model families (pattern, ignore_merges). Unknown names fall back to GPT-2's own regex.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
_GGUF_SPLITS = {
    "llama-bpe": (_LLAMA3_PATTERN, True),
    "llama3": (_LLAMA3_PATTERN, True),
    "qwen2": (_QWEN2_PATTERN, False),
}


def _gguf_pre_tokenizer(pre: str | None) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    if pre == "smollm":
        # SmolLM2's tokenizer.json: every digit its own piece, then GPT-2's byte-level split.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        ), False
    if pre in _GGUF_SPLITS:
        pattern, ignore_merges = _GGUF_SPLITS[pre]
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ), ignore_merges
    return pre_tokenizers.ByteLevel(add_prefix_space=False), False


def _from_gguf(path: Path) -> TextTokenizer:
    meta = read_gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(
            f"{str(path)!r} has a {kind!r} tokenizer; only byte-level BPE ('gpt2') GGUF tokenizers are "
            "supported: pass tokenizer_path pointing at the model's tokenizer.json instead."
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens", [])
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    if not tokens or not merges:
        raise TokenizerError(f"{str(path)!r} lacks tokenizer.ggml.tokens/merges: pass tokenizer_path explicitly.")
    pre_tokenizer, ignore_merges = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    # GGUF stores byte-level vocab strings already spelled in the GPT-2 byte alphabet, as in tokenizer.json.
    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)}, merges=merges, ignore_merges=ignore_merges
    )
    tokenizer = tokenizers.Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens must match whole in raw text, or `<|im_start|>` would be
    # split into byte-level pieces; control tokens are also dropped by decode(skip_special_tokens).
    token_types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    typed = list(zip(tokens, token_types))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == 3])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == 4])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = token_ids(meta.get("tokenizer.ggml.eos_token_id")) + token_ids(meta.get("tokenizer.ggml.eot_token_id"))
    config = {name: tokens[i] for name, key in (("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id"))
              if isinstance(i := meta.get(f"tokenizer.ggml.{key}"), int) and 0 <= i < len(tokens)}
    return TextTokenizer(
        tokenizer=tokenizer,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        config=config,
    )


# --- chat templates -------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _template_variables(source: str) -> frozenset[str]:
    from jinja2 import Environment, meta
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols

    try:
        return frozenset(meta.find_undeclared_variables(Environment(extensions=[loopcontrols]).parse(source)))
    except TemplateError:
        return frozenset()


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    """Compile once per template text; the environment mirrors transformers' (sandboxed, trimmed)."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson  # jinja's own escapes HTML characters, which prompts must keep
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise TokenizerError(f"The chat template does not compile: {exc}. Fix the model's chat_template.") from exc
