"""The seed's named configuration presets (CONFIGURATION.md, "Configuration Presets"): `--preset NAME`
applies one under the file, env and CLI layers (hetero_infer/config_sources.py)."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "low_latency": dict(block_size=16, max_num_blocks=512, max_batch_size=8, max_num_seqs=64,
                        max_model_len=1024, max_total_tokens=1024, memory_threshold=0.8),
    "high_throughput": dict(block_size=32, max_num_blocks=4096, max_batch_size=128, max_num_seqs=1024,
                            max_model_len=4096, max_total_tokens=16384, memory_threshold=0.95),
    "memory_constrained": dict(block_size=16, max_num_blocks=256, max_batch_size=16, max_num_seqs=128,
                               max_model_len=1024, max_total_tokens=2048, memory_threshold=0.85),
    "long_context": dict(block_size=32, max_num_blocks=2048, max_batch_size=16, max_num_seqs=64,
                         max_model_len=8192, max_total_tokens=8192, memory_threshold=0.9),
}
