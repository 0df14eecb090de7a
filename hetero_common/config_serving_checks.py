"""The checks of the gateway's sections (`serving.*`, `tokenizer.*`), apart from config.py so that
module keeps room for the engine's keys. `Config.validate` calls `check_serving` with its own
`_check`, which `python -m hetero_infer.config_doc` replaces to record every rule."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hetero_common.config_sections import ServingConfig, TokenizerConfig

Check = Callable[[bool, str, object, str], None]


def check_serving(serving: ServingConfig, tokenizer: TokenizerConfig, _check: Check) -> None:
    """Raise (through `_check`) on the first bad `serving.*` or `tokenizer.*` key."""
    _check(1 <= serving.port <= 65535, "serving.port", serving.port, "must be a TCP port (1-65535)")
    _check(bool(serving.model_name), "serving.model_name", serving.model_name, "must not be empty")
    backend = serving.backend
    _check(backend.kind in ("scheduler", "command_bridge"), "serving.backend.kind", backend.kind,
           "must be scheduler (alias local_engine) or command_bridge")
    _check(backend.kind != "command_bridge" or (backend.command is not None and bool(backend.command.program)),
           "serving.backend.command.program", None, "is required when serving.backend.kind is command_bridge")
    _check(backend.command_timeout_s > 0, "serving.backend.command_timeout_s", backend.command_timeout_s, "must be positive")
    _check(backend.command_max_output_bytes > 0, "serving.backend.command_max_output_bytes",
           backend.command_max_output_bytes, "must be positive")
    _check(0 <= serving.http_port <= 65535, "serving.http_port", serving.http_port,
           "must be a TCP port (1-65535), or 0 to disable the HTTP API")
    _check(serving.http_port != serving.port, "serving.http_port", serving.http_port,
           f"must differ from serving.port ({serving.port})")
    _check(serving.max_concurrent_requests >= 0, "serving.max_concurrent_requests",
           serving.max_concurrent_requests, "must be >= 0 (0 = no limit)")
    _check(serving.tokenizer_workers >= 1, "serving.tokenizer_workers", serving.tokenizer_workers, "must be >= 1")
    _check(serving.tokenizer_queue >= 0, "serving.tokenizer_queue", serving.tokenizer_queue, "must be >= 0")
    _check(serving.stream_interval >= 1, "serving.stream_interval", serving.stream_interval,
           "must be >= 1 (tokens per streamed message; 1 = every token at once)")
    _check(1024 <= serving.max_request_bytes <= 1 << 30, "serving.max_request_bytes", serving.max_request_bytes,
           "must be in 1024..1073741824 (1 KiB..1 GiB)")
    _check(serving.max_connections >= 0, "serving.max_connections", serving.max_connections, "must be >= 0 (0 = no limit)")
    _check(serving.grpc_max_concurrent_streams >= 1, "serving.grpc_max_concurrent_streams",
           serving.grpc_max_concurrent_streams, "must be >= 1")
    for key in ("http_keep_alive_timeout_s", "http_header_timeout_s", "http_body_timeout_s", "grpc_idle_timeout_s"):
        _check(getattr(serving, key) > 0, f"serving.{key}", getattr(serving, key), "must be positive (seconds)")
    for key in ("api_keys", "admin_api_keys"):
        _check(all(k.strip() == k and k for k in getattr(serving, key)), f"serving.{key}", "<redacted>",
               "must not hold empty keys or keys with surrounding spaces")
    for key in ("api_keys_file", "admin_api_keys_file"):
        path = getattr(serving, key)
        _check(not path or Path(path).is_file(), f"serving.{key}", path, "must be an existing file (one key per line)")
    _check(serving.max_prompts_per_request >= 1, "serving.max_prompts_per_request", serving.max_prompts_per_request,
           "must be >= 1")
    _check(backend.command_max_concurrent >= 1, "serving.backend.command_max_concurrent",
           backend.command_max_concurrent, "must be >= 1")
    _check(all(name.isidentifier() for name in backend.command_env), "serving.backend.command_env",
           backend.command_env, "must list environment variable names")
    pooling, max_inputs = serving.embedding.pooling, serving.embedding.max_inputs
    _check(pooling in ("auto", "last", "mean", "cls"), "serving.embedding.pooling", pooling, "must be auto, last, mean or cls")
    _check(max_inputs >= 1, "serving.embedding.max_inputs", max_inputs, "must be >= 1")
    _check(tokenizer.kind in ("auto", "huggingface", "gguf", "simple"), "tokenizer.kind", tokenizer.kind,
           "must be auto, huggingface, gguf or simple (the built-in byte-level tokenizer)")
    _check(tokenizer.kind != "simple" or not tokenizer.path, "tokenizer.path", tokenizer.path,
           "must be null when tokenizer.kind is simple (it is built in)")
    for kind in ("huggingface", "gguf"):  # one check per kind: each rule reads true in docs/configuration.md
        _check(tokenizer.kind != kind or bool(tokenizer.path), "tokenizer.path", tokenizer.path,
               f"is required when tokenizer.kind is {kind}")
    _check(tokenizer.kind != "gguf" or str(tokenizer.path).endswith(".gguf"), "tokenizer.path",
           tokenizer.path, "must be a .gguf file when tokenizer.kind is gguf")
    _check(tokenizer.kind != "huggingface" or not str(tokenizer.path).endswith(".gguf"), "tokenizer.path",
           tokenizer.path, "must be a tokenizer.json (or a directory holding one) when tokenizer.kind is huggingface")
