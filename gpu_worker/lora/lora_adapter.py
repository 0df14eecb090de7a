"""A LoRA adapter in PEFT's format, read from its directory and checked against the served model (issue 41).

PEFT saves `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, `target_modules`, ...) and
`adapter_model.safetensors`, whose tensors are named `base_model.model.<module>.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). A target's output gains `scaling * B @ (A @ x)`, with scaling `lora_alpha / r`,
or `lora_alpha / sqrt(r)` with rsLoRA.

Everything an adapter could ask for that this engine would not compute is refused with an error naming it:
a missing file, a module the served model lacks, shapes that do not fit it, a rank over `max_lora_rank`,
DoRA, biases, per-module ranks, `modules_to_save`, `fan_in_fan_out`. An adapter that loads is exactly what
PEFT computes; one that does not leaves the served model and the other adapters as they were.

The files are untrusted input (issue 58): a run-time load (`LoadLora`) names a path a client sent. Such a
path must lie under `lora_root` once resolved (symlinks followed), and so must each file in it; a path given
relative is taken under `lora_root` (adapter_files.py finds and opens the files). Adapters of `lora_modules` come from the operator's own configuration and
are read where they are (`root=None`). Either way the sizes are checked before anything large is read:
adapter_config.json is capped, and the safetensors header (parsed here, not by the library) must describe
exactly the tensors the served model's shapes at the adapter's rank allow, tiling the file, before a tensor
byte is read. Every failure, whatever the file holds, is a LoraAdapterError.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import structlog
import torch

from gpu_worker.lora.adapter_files import LoraAdapterError, confined_directory, open_file, read_capped
from gpu_worker.model_config import ModelConfig

log = structlog.get_logger("gpu_worker.lora.lora_adapter")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Layer numbers of at most 9 digits: a longer run is no layer (and int() of thousands of digits raises).
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d{1,9})\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
CONFIG_MAX_BYTES = 1 << 20  # adapter_config.json: PEFT's are a few KiB
HEADER_MAX_BYTES = 16 << 20  # the safetensors header (the library's own limit on reading one is 100 MB)
# The dtypes an adapter's weights may be stored in (safetensors' names), and their sizes.
DTYPES: dict[str, tuple[torch.dtype, int]] = {"F64": (torch.float64, 8), "F32": (torch.float32, 4),
                                              "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2)}
_WIDEST = max(size for _, size in DTYPES.values())


Refuse = Callable[[str], LoraAdapterError]  # the error for one adapter (or file), given why


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    targets: frozenset[str]  # the module names it adapts (q_proj, ..., down_proj)
    # (layer, target) -> (A [rank, in], B [out, rank]), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Tensor:
    """One tensor as the safetensors header describes it, checked against the served model."""

    layer: int
    target: str
    part: str  # "A" or "B"
    dtype: torch.dtype
    shape: tuple[int, int]
    begin: int  # its bytes in the data area (after the header)
    end: int


def target_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """(out, in) of one of the served model's linear layers."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
            "up_proj": (inter, h), "down_proj": (h, inter)}[target]


def load_lora_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int, *,
                      root: Path | None = None) -> LoraAdapter:
    """The adapter `name` in `path`, checked against the served model's `config` and `max_rank`.

    `root`: for a path a client sent (a run-time load), the resolved `lora_root` the directory and its files
    must lie under (`adapter_files.run_time_root`); None only for the operator's own paths (`lora_modules`, benchmarks)."""
    directory = Path(path) if root is None else confined_directory(name, Path(path), root)
    settings = _read_settings(name, directory, Path(path), root)
    rank, targets = _check_settings(name, settings, max_rank)
    if config.moe is not None and (mlp := sorted(targets & {"gate_proj", "up_proj", "down_proj"})):
        raise LoraAdapterError(f"LoRA adapter {name!r}: targets {mlp}, but the served {config.architecture} model's "
                               "MLPs are mixtures of experts, which LoRA is not served on; target its attention "
                               "(q_proj, k_proj, v_proj, o_proj)", "lora")
    weights = _read_weights(name, directory, Path(path), root, config, rank)
    found = {target for _, target in weights}
    if missing := targets - found:
        raise LoraAdapterError(f"LoRA adapter {name!r}: adapter_config.json targets {sorted(missing)} but "
                               "adapter_model.safetensors holds no weights for them", "lora")
    alpha = settings.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    return LoraAdapter(name, rank, float(scaling), frozenset(found), weights)


# --- adapter_config.json ---

def _show(value: Any) -> str:
    """A value from the file, for a message: short, whatever the file holds."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _no_constant(word: str) -> Any:
    raise ValueError(f"{word} is not a JSON number")


def _parse_json(name: str, data: bytes, shown: Path, **hooks: Any) -> Any:
    try:
        return json.loads(data, parse_constant=_no_constant, **hooks)
    except RecursionError:
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(shown)!r} nests too deeply to be read", "lora") from None
    except (ValueError, TypeError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(shown)!r} is not valid JSON: {_show(str(exc))}",
                               "lora") from None


def _read_settings(name: str, directory: Path, path: Path, root: Path | None) -> dict:
    shown = path / "adapter_config.json"
    stream, size = open_file(name, directory, shown, root)
    with stream:
        if size > CONFIG_MAX_BYTES:
            raise LoraAdapterError(f"LoRA adapter {name!r}: {str(shown)!r} is {size} bytes, over the "
                                   f"{CONFIG_MAX_BYTES} a PEFT adapter_config.json could need", "lora")
        data = read_capped(name, stream, size, shown)
    settings = _parse_json(name, data, shown)
    if not isinstance(settings, dict):
        raise LoraAdapterError(f"LoRA adapter {name!r}: {str(shown)!r} must hold a JSON object", "lora")
    return settings


def _is_number(value: Any) -> bool:
    """A finite JSON number (not a boolean, which Python counts as an int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer of hundreds of digits
        return False


def _check_settings(name: str, settings: dict, max_rank: int) -> tuple[int, set[str]]:
    """(its rank, the modules it targets), or the first setting this engine does not serve."""
    def refuse(why: str) -> LoraAdapterError:
        return LoraAdapterError(f"LoRA adapter {name!r}: {why}", "lora")

    peft_type = settings.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise refuse(f"peft_type {_show(peft_type)} is not served (only LORA)")
    rank = settings.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse(f"r = {_show(rank)} must be a positive integer")
    if rank > max_rank:
        raise refuse(f"rank {rank} is over max_lora_rank ({max_rank}); raise max_lora_rank or use a smaller rank")
    if not _is_number(settings.get("lora_alpha", rank)):
        raise refuse(f"lora_alpha = {_show(settings.get('lora_alpha'))} must be a finite number")
    if not isinstance(settings.get("use_rslora", False), (bool, type(None))):
        raise refuse(f"use_rslora = {_show(settings.get('use_rslora'))} must be true or false")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights"),
                     ("modules_to_save", "modules_to_save (full copies of modules)"),
                     ("rank_pattern", "per-module ranks (rank_pattern)"), ("alpha_pattern", "per-module alphas"),
                     ("layers_to_transform", "layers_to_transform"), ("lora_bias", "LoRA biases (lora_bias)"),
                     ("layer_replication", "layer_replication"), ("target_parameters", "target_parameters"),
                     ("trainable_token_indices", "trainable tokens"), ("alora_invocation_tokens", "aLoRA"),
                     ("use_qalora", "QA-LoRA"), ("use_bdlora", "BD-LoRA")):
        if settings.get(key):
            raise refuse(f"{why} is not served")
    if settings.get("bias", "none") != "none":
        raise refuse(f"bias = {_show(settings.get('bias'))} is not served (only none)")
    targets = _targets(settings.get("target_modules"), refuse)
    if not targets:
        raise refuse("target_modules names none of the served model's modules")
    return rank, targets


def _targets(modules: Any, refuse: Refuse) -> set[str]:
    """The served model's modules `target_modules` names: a list of names, or a regex as PEFT allows."""
    if isinstance(modules, str):
        try:
            # Searched in the short target names only: a pathological pattern has little to backtrack over.
            return {t for t in TARGETS if re.search(modules, t)}
        except (re.error, RecursionError, OverflowError) as exc:
            raise refuse(f"target_modules {_show(modules)} is not a valid regex ({_show(str(exc))})") from None
    if isinstance(modules, list) and all(isinstance(m, str) for m in modules):
        names = {m.rsplit(".", 1)[-1] for m in modules}
        if unknown := names - set(TARGETS):
            raise refuse(f"target_modules {_show(sorted(unknown))} are not modules of the served model "
                         f"(it has {', '.join(TARGETS)})")
        return names
    raise refuse(f"target_modules = {_show(modules)} must be a list of module names or a regex")


# --- adapter_model.safetensors: the header checked, then the tensors read ---

def _max_data_bytes(config: ModelConfig, rank: int) -> int:
    """The most tensor bytes a rank-`rank` adapter of the served model can hold: every target of every layer,
    in the widest dtype allowed."""
    per_layer = sum(rank * (out + inp) for out, inp in (target_shape(config, t) for t in TARGETS))
    return config.num_hidden_layers * per_layer * _WIDEST


def _read_weights(name: str, directory: Path, path: Path, root: Path | None, config: ModelConfig,
                  rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shown = path / "adapter_model.safetensors"
    stream, size = open_file(name, directory, shown, root)
    with stream:
        bound = 8 + HEADER_MAX_BYTES + _max_data_bytes(config, rank)
        if size > bound:
            raise LoraAdapterError(f"LoRA adapter {name!r}: {str(shown)!r} is {size} bytes, more than any rank-{rank} "
                                   f"adapter of the served model holds ({bound}); it was made for another base "
                                   "model, or is not an adapter", "lora")
        header_size, tensors = _read_header(name, stream, size, shown, config, rank)
        data = bytearray(size - 8 - header_size)
        try:
            got = stream.readinto(data)
        except OSError as exc:
            raise LoraAdapterError(f"LoRA adapter {name!r}: cannot read {str(shown)!r} ({exc.strerror})",
                                   "lora") from None
        if got != len(data):
            raise LoraAdapterError(f"LoRA adapter {name!r}: {str(shown)!r} is truncated (it changed while it was "
                                   "read?); write it again", "lora")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in tensors:
        # Copied out of the file's bytes (aligned for its dtype whatever the offsets), then made float32.
        raw = torch.frombuffer(data, dtype=torch.uint8, count=t.end - t.begin, offset=t.begin).clone()
        weight = raw.view(t.dtype).reshape(t.shape).float()
        if not bool(torch.isfinite(weight).all()):  # NaN would reach every token of the adapter's requests
            raise LoraAdapterError(f"LoRA adapter {name!r}: {str(shown)!r} holds NaN or infinite values in layer "
                                   f"{t.layer} {t.target}'s lora_{t.part}: it is damaged, or its training "
                                   "diverged", "lora")
        parts.setdefault((t.layer, t.target), {})[t.part] = weight
    return {key: (pair["A"].contiguous(), pair["B"].contiguous()) for key, pair in sorted(parts.items())}


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a key appears twice among {_show(keys)}")
    return dict(pairs)


def _read_header(name: str, stream: BinaryIO, size: int, shown: Path, config: ModelConfig,
                 rank: int) -> tuple[int, list[_Tensor]]:
    """(the header's length, its tensors), each checked against the served model, tiling the data area."""
    def refuse(why: str) -> LoraAdapterError:
        return LoraAdapterError(f"LoRA adapter {name!r}: {str(shown)!r} {why}", "lora")

    try:
        prefix = stream.read(8)
        if len(prefix) < 8:
            raise refuse(f"is truncated ({size} bytes: not even the header's length); write it again")
        header_size = int.from_bytes(prefix, "little")
        if header_size > HEADER_MAX_BYTES:
            raise refuse(f"claims a {header_size}-byte header, over the {HEADER_MAX_BYTES} an adapter's could need; "
                         "it is not a safetensors file, or is damaged")
        if 8 + header_size > size:
            raise refuse(f"is truncated: its header claims {header_size} bytes but the file holds {size}; write it "
                         "again")
        raw = stream.read(header_size)
    except OSError as exc:
        raise refuse(f"cannot be read ({exc.strerror})") from None
    if len(raw) != header_size:
        raise refuse("is truncated (it changed while it was read?); write it again")
    header = _parse_json(name, raw, shown, object_pairs_hook=_no_duplicates)
    if not isinstance(header, dict):
        raise refuse("has a header that is not a JSON object: it is not a safetensors file")
    tensors = [_check_entry(key, entry, config, rank, refuse) for key, entry in header.items()
               if key != "__metadata__"]
    _check_tiling(tensors, size - 8 - header_size, refuse)
    _check_pairs(name, tensors)
    return header_size, tensors


def _check_entry(key: str, entry: Any, config: ModelConfig, rank: int, refuse: Refuse) -> _Tensor:
    """One header entry: a LoRA weight of one of the served model's modules, of the shape that module and
    `rank` need, its byte range as long as its dtype and shape make it."""
    match = _TENSOR.fullmatch(key)
    if match is None or match.group(3) not in TARGETS:
        raise refuse(f"holds tensor {_show(key)}, which is not a LoRA weight of a module the served model has")
    layer, target, part = int(match.group(1)), match.group(3), match.group(4)
    if layer >= config.num_hidden_layers:
        raise refuse(f"holds tensor {_show(key)} for layer {layer}, but the served model has "
                     f"{config.num_hidden_layers} layers")
    if not isinstance(entry, dict):
        raise refuse(f"describes tensor {_show(key)} with {_show(entry)}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise refuse(f"stores tensor {_show(key)} as {_show(dtype)}; an adapter's weights must be one of "
                     f"{', '.join(DTYPES)}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
        raise refuse(f"gives tensor {_show(key)} the shape {_show(shape)}, not a list of integers")
    out, inp = target_shape(config, target)
    want = (rank, inp) if part == "A" else (out, rank)
    if tuple(shape) != want:
        raise refuse(f"has layer {layer} {target}'s lora_{part} {_show(tuple(shape))}; the served model at rank "
                     f"{rank} needs {want}: it was trained for another base model")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            and offsets[0] <= offsets[1]):
        raise refuse(f"gives tensor {_show(key)} the data_offsets {_show(offsets)}, not [begin, end]")
    begin, end = offsets
    if end - begin != want[0] * want[1] * DTYPES[dtype][1]:
        raise refuse(f"gives tensor {_show(key)} {end - begin} bytes, but {dtype} {want} takes "
                     f"{want[0] * want[1] * DTYPES[dtype][1]}")
    return _Tensor(layer, target, part, DTYPES[dtype][0], want, begin, end)


def _check_tiling(tensors: list[_Tensor], data_size: int, refuse: Refuse) -> None:
    """The tensors' byte ranges cover the data area after the header exactly, without holes or overlaps (as
    safetensors requires): no byte is read that no tensor describes."""
    at = 0
    for t in sorted(tensors, key=lambda t: t.begin):
        if t.begin != at:
            raise refuse(f"has tensors overlapping or apart at byte {t.begin} of its data (expected {at}): it is "
                         "damaged")
        at = t.end
    if at > data_size:
        raise refuse(f"is truncated: its header describes {at} bytes of tensors but {data_size} follow it; write "
                     "it again")
    if at < data_size:
        raise refuse(f"holds {data_size - at} bytes after its last tensor: it is damaged")


def _check_pairs(name: str, tensors: list[_Tensor]) -> None:
    """Every target of every layer has both lora_A and lora_B."""
    parts: dict[tuple[int, str], set[str]] = {}
    for t in tensors:
        parts.setdefault((t.layer, t.target), set()).add(t.part)
    for (layer, target), have in sorted(parts.items()):
        if have != {"A", "B"}:
            raise LoraAdapterError(f"LoRA adapter {name!r}: layer {layer} {target} has lora_"
                                   f"{'B' if 'B' not in have else 'A'} missing", "lora")
