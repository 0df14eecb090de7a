"""The seeded prompts that the correctness tests (and the stack's request helpers) run: lengths from
one token to several blocks, so that every step mixes prefills and decodes."""

from __future__ import annotations

import torch

PROMPT_LENGTHS = [1, 2, 5, 9, 16, 17, 33, 50]
NEW_TOKENS = 12


def make_prompts(vocab: int = 384, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
