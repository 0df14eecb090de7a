"""The seed documents' own forms (/work/shared/seeds): its config.json verbatim and its
command-bridge config, as files tests write and run."""

from __future__ import annotations

import json
from pathlib import Path

# The seed README's config.json, verbatim.
SEED_CONFIG = {
    "block_size": 16,
    "max_num_blocks": 1024,
    "max_batch_size": 32,
    "max_num_seqs": 256,
    "max_model_len": 2048,
    "max_total_tokens": 4096,
    "memory_threshold": 0.9,
    "max_retry_attempts": 2,
    "tokenizer": {"kind": "simple", "path": None},
    "serving": {"host": "127.0.0.1", "port": 3000, "model_name": "hetero-infer",
                "backend": {"kind": "local_engine", "command": None}},
}
# The seed README's command-bridge mode, verbatim.
SEED_BRIDGE_CONFIG = {"serving": {"backend": {"kind": "command_bridge", "command": {
    "program": "/bin/sh", "args": ["-c", "printf 'bridge:%s' \"$HETERO_PROMPT\""]}}}}


def write_config(directory: Path, data: dict, name: str = "config.json") -> Path:
    path = directory / name
    path.write_text(json.dumps(data, indent=2))
    return path
