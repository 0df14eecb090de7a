"""The logits of every position of one prompt, through a model and attention backend on a KV cache of its own
(one prefill step; prompts of up to 64 tokens): what the quantization tests compare between serving modes."""

from __future__ import annotations

import numpy as np
import torch

from kernels.cache_ops import allocate_kv_cache
from kernels.page_table import PageTable

BLOCK, PAGES = 16, 4


def prompt_logits(model, attention, kv_dtype: torch.dtype, prompt: list[int]) -> torch.Tensor:
    """float32 logits [len(prompt), vocab] of `model` (gpu_worker.models.model.LlamaModel) over `prompt`."""
    c = model.config
    cache = allocate_kv_cache(c.num_hidden_layers, PAGES, BLOCK, model.num_kv_heads, c.head_dim, kv_dtype, "cpu",
                              attention.kv_layout)
    table = PageTable.build([np.arange(PAGES, dtype=np.int32)], np.array([len(prompt)]), np.array([len(prompt)]),
                            BLOCK)
    attention.plan(table)
    positions, slots = table.token_positions()
    with torch.inference_mode():
        return model.forward(torch.tensor(prompt), torch.from_numpy(positions), torch.from_numpy(slots), cache,
                             attention, torch.arange(len(prompt)))


def engine_prompt_logits(engine, prompt: list[int]) -> torch.Tensor:
    """`prompt_logits` through an in-process engine's model, attention backend and cache element."""
    runner = engine.runner
    return prompt_logits(runner.model, runner.attention, runner.kv_dtype, prompt)
