"""The garbage collector as the services run it once they have started.

CPython's cyclic collector starts a young-generation pass every 700 allocations, and every
so often a full pass over every tracked object. A serving process allocates in every step
(plan bytes, token events, protobuf wrappers) and keeps a large heap that never becomes
garbage (modules, the model, the tokenizer), so the collector runs often and mostly re-reads
what cannot be freed. After start-up the heap so far is frozen out of the collector
(`gc.freeze`) and a pass starts every 50,000 allocations: in the scheduler's own benchmark
(benchmarks/scheduler_bench.py) that is 3-7% of its time per step. Reference counting still
frees everything that is not a cycle at once; cycles wait a little longer.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000  # allocations between young-generation passes (CPython's default: 700)


def tune_gc() -> None:
    """Freeze the start-up heap out of the collector and collect less often (idempotent)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
