"""The scheduling loop's core: the waiting queue and the requests in flight, the `Scheduler` that
decides each step (continuous batching, chunked prefill, whom to preempt), the `StepPlan` it writes for
the worker, the step in flight (overlap), and reading the worker's result into token outputs, stats
and limits. It asks `kv/` for blocks and never touches a reference count or a block table; the
`Sequence` record it moves through all this is `scheduler_svc/sequence.py`.
"""
