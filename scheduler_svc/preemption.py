"""Whom to preempt when blocks run out.

The scheduler preempts a running sequence that is not in this step's batch so that another can
grow (`Scheduler._reserve`), in one of two ways (`Scheduler._preempt`): `recompute` frees its
blocks and re-queues it at the front of its priority class with every token so far (prompt plus
output), to be computed again; `swap` has the worker copy its blocks to host memory, and it waits
in the `SwappedQueue` until it fits again. Either way its stream neither loses nor repeats a token.
"""

from __future__ import annotations

from scheduler_svc.sequence import Sequence


def preemption_victim(running: list[Sequence], seq: Sequence, step_id: int, any_priority: bool) -> Sequence:
    """Whom to preempt so that `seq` can grow: the lowest-priority running sequence (highest value)
    not in this step's batch, among equals the newest; `seq` itself when none can give way, or
    when its own priority is strictly lower than every candidate's. `any_priority` False (every
    priority 0 so far) takes the plain newest-first path, which is all FIFO needs."""
    if not any_priority:
        return next((s for s in reversed(running) if s is not seq and s.last_scheduled_step != step_id), seq)
    victim = None
    for s in reversed(running):  # newest first; only a strictly larger value replaces, so ties keep the newest
        if s is not seq and s.last_scheduled_step != step_id and (victim is None or s.priority > victim.priority):
            victim = s
    return seq if victim is None or seq.priority > victim.priority else victim
