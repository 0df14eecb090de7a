"""What a token costs the worker's step, measured, so that speculation stops where it would cost throughput
(issue 40: "proposals stop when the batch is large enough that the step is compute-bound, measured on the
worker, not hard-coded").

A step's time on the worker (StepResult.forward_seconds) against the tokens it computed fits
t = a + b * tokens over the last `WINDOW` steps (least squares): a is what a step costs whatever its size
(the weights read once; on GPUs, the launches), b what each token adds. A decode batch of B sequences with D
draft tokens, a fraction alpha of them kept, makes B + alpha * D tokens in a + b * (B + D) seconds against B
in a + b * B: the drafts pay when alpha > b * B / (a + b * B), the share of the step that grows with its
tokens (`threshold`). At batch 1 on a memory-bound device that share is small and nearly any draft pays; as
the batch grows towards compute-bound it nears 1 and only drafts that are nearly always kept still pay.

A draft model's proposals cost time too (StepResult.draft_seconds, left out of the fit): d seconds per draft
token once it has caught up with its sequences (draft_proposal_seconds; a sequence's prompt at its first
drafted decode is a one-time cost), a running average, and the drafts pay when
alpha > (b + d) * B / (a + b * B). A draft model that costs much and agrees little is asked for nothing.
"""

from __future__ import annotations

from collections import OrderedDict, deque

WINDOW = 64  # steps in the fit
MIN_SPREAD = 2.0  # tokens: the fit waits for steps of different sizes (their standard deviation at least this)


class StepCostModel:
    """The fit of recent steps' times to their token counts, and the acceptance a draft needs at a batch size."""

    __slots__ = ("_planned", "_samples", "a", "b", "batch", "draft_per_token")

    def __init__(self) -> None:
        self._planned: OrderedDict[int, int] = OrderedDict()  # step id -> tokens, until its result comes
        self._samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (tokens, seconds)
        self.a = self.b = 0.0  # seconds per step, seconds per token; 0, 0: not fitted yet
        self.batch = 1  # sequences running when the last step was planned: the next step's batch, about
        self.draft_per_token = 0.0  # a draft model's seconds per proposed token, a running average

    def planned(self, step_id: int, num_tokens: int, num_running: int) -> None:
        self._planned[step_id] = num_tokens
        while len(self._planned) > 8:  # plans that never reached a worker (nothing to compute) get no result
            self._planned.popitem(last=False)
        self.batch = max(1, num_running)

    def observe(self, step_id: int, seconds: float, draft_seconds: float = 0.0, proposal_seconds: float = 0.0,
                model_drafts: int = 0) -> None:
        """A step's result: its time, of which `draft_seconds` a draft model's, `proposal_seconds` of those what
        proposing `model_drafts` tokens costs once it has caught up (StepResult.draft_proposal_seconds)."""
        if model_drafts:
            per_token = proposal_seconds / model_drafts
            self.draft_per_token = 0.7 * self.draft_per_token + 0.3 * per_token if self.draft_per_token else per_token
        tokens = self._planned.pop(step_id, None)
        if tokens is None or seconds <= 0:
            return
        self._samples.append((tokens, seconds - draft_seconds))
        n = len(self._samples)
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self._samples) / n
        if var_x < MIN_SPREAD**2:
            return
        b = sum((x - mean_x) * (y - mean_y) for x, y in self._samples) / n / var_x
        self.b = max(b, 0.0)
        self.a = max(mean_y - self.b * mean_x, 0.0)

    def measured(self) -> bool:
        """Whether the fit and a draft model's cost are known (a proposer without a model costs nothing)."""
        return self.b > 0 and self.draft_per_token > 0

    def threshold(self) -> float:
        """The fraction of drafts that must be kept for drafting to pay at the current batch (0 before a fit)."""
        grows = self.b * self.batch
        return (grows + self.draft_per_token * self.batch) / (self.a + grows) if grows > 0 else 0.0
