"""The seeded prompts that the correctness tests (and the stack's request helpers) run: lengths from
one token to several blocks, so that every step mixes prefills and decodes; and the chat prompts that the
default model's oracle checks (tests/model) send as text, and the 16 of quantized serving's accuracy oracle
(benchmarks/quant_accuracy.py: those 8 and 8 more)."""

from __future__ import annotations

import torch

PROMPT_LENGTHS = [1, 2, 5, 9, 16, 17, 33, 50]
NEW_TOKENS = 12


def make_prompts(vocab: int = 384, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about paged attention and continuous batching in large language model servers.",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Explain in one sentence why the sky is blue, using simple words that a child would understand easily.",
    "Translate to French: good morning",
    "def fibonacci(n):",
]

# Issue 39's oracle set: the 8 above and 8 more of other kinds (arithmetic, lists, code, a long instruction,
# a question of fact, dialogue, a definition, a story opening).
ORACLE_PROMPTS = CHAT_PROMPTS + [
    "What is 17 times 23?",
    "List three primary colors.",
    "import numpy as np\n# compute the mean of a list of numbers",
    "Summarize the plot of Romeo and Juliet in two sentences, mentioning both families and how the story ends.",
    "Who wrote the novel Pride and Prejudice?",
    "Can you help me plan a short trip to the mountains this weekend?",
    "Define photosynthesis.",
    "Once upon a time, in a small village by the sea,",
]
