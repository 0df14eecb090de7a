"""Constrained decoding in the worker: one llguidance matcher per constrained sequence.

Each step, for the rows of the batch that carry a constraint (hetero_common/constraints.py), the
matchers fill a token bitmask; the sampler masks those rows' logits with it after the other logits
controls and before temperature, min_p, top-k and top-p (gpu_worker/sampling/sampler.py), so constrained and
unconstrained rows share one batched sampler and a step without a constrained row pays nothing. After
sampling, each matcher consumes its row's token. Once a constraint is complete the matcher allows
only EOS, so the sample ends with EOS and the scheduler finishes it with FINISH_REASON_STOP.

A speculative decode's rows (gpu_worker/sampling/draft_rows.py) share their sequence's matcher: row j's mask is the
one after the drafts d_1..d_j, computed by consuming them and rolling the matcher back, and after the step
the matcher consumes what the sequence kept (`advance_drafted`), so a rejected draft never advances the
grammar. A row past a draft the grammar refuses allows every token: verification stops before it (the row
before masks that draft out).

A matcher is built at a sequence's first sampled step on this worker from its token ids and
`num_generated`: it replays the generated tokens, which is what a recompute preemption or an n > 1
fork needs (they arrive as new sequences carrying prompt + generated ids). A swapped-out sequence keeps
its state here. A prefix-cache hit changes nothing: the matcher follows tokens, not KV.

Failures (no tokenizer for llguidance, a grammar this vocabulary cannot serve, a matcher that errs) fail
that sample alone: it comes back in StepResult.failures and the scheduler ends it with an
error; the worker and the other rows go on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import structlog
import torch

from hetero_common.constraints import ConstraintSpec, build_ll_tokenizer, check_grammar, grammar_text
from hetero_common.sampling import Sampling

log = structlog.get_logger("gpu_worker.sampling.constrained")


class GuidanceVocabulary:
    """llguidance's view of the served model's vocabulary, built once, at the first constrained request
    (about a second for a 50k vocabulary; a worker that never sees a constraint never pays it)."""

    def __init__(self, load_tokenizer_json: Callable[[], str], eos_token_ids: Sequence[int], vocab_size: int) -> None:
        self._load = load_tokenizer_json
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        self.vocab_size = vocab_size  # the model's (the logits' width); may exceed the tokenizer's
        self._tokenizer: Any = None
        self.error = ""

    @property
    def tokenizer(self) -> Any:
        """The LLTokenizer, or None when it cannot be built (`error` says why)."""
        if self._tokenizer is None and not self.error:
            try:
                self._tokenizer = build_ll_tokenizer(self._load(), self.eos_token_ids, self.vocab_size)
            except Exception as exc:  # any failure here must fail the constrained requests, not the worker
                self.error = f"cannot build llguidance's tokenizer for this model: {exc}"
                log.error("constrained decoding unavailable", error=self.error)
        return self._tokenizer


@dataclass
class RowConstraint:
    """One sequence's matcher; `error` set: the sample fails (the matcher is not used again)."""

    matcher: Any = None
    error: str = ""

    def fail(self, error: str) -> None:
        if not self.error:
            self.error = error
            log.error("constrained sample failed", error=error)


def build_row_constraint(spec: ConstraintSpec, token_ids: Sequence[int], num_generated: int,
                         vocabulary: GuidanceVocabulary) -> RowConstraint:
    """A matcher for `spec` that has consumed the last `num_generated` of `token_ids` (the tokens generated
    before this worker saw the sequence: after a recompute preemption or a fork)."""
    from llguidance import LLMatcher, LLParserLimits

    rc = RowConstraint()
    tokenizer = vocabulary.tokenizer
    if tokenizer is None:
        rc.fail(vocabulary.error)
        return rc
    try:
        grammar = grammar_text(spec)
        check_grammar(spec, grammar, tokenizer)  # raises with llguidance's message, as the gateway's check does
        # Terse errors: the verbose ones dump the parser's state and grammar into the log.
        rc.matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=LLParserLimits(verbose_errors=False))
    except Exception as exc:  # the gateway validated it: only a vocabulary that differs from its tokenizer gets here
        rc.fail(f"{spec.field} does not compile on the worker: {exc}")
        return rc
    generated = list(token_ids[len(token_ids) - num_generated:]) if num_generated else []
    if generated and not rc.matcher.consume_tokens(generated):
        rc.fail(f"{spec.field}: replaying the {num_generated} generated tokens failed: {rc.matcher.get_error()}")
    elif rc.matcher.is_error():
        rc.fail(f"{spec.field}: {rc.matcher.get_error()}")
    return rc


class ConstrainedSequence(Protocol):
    """What the worker keeps per sequence (gpu_worker.step_io.SequenceState), or a drafted row
    (draft_rows.DraftRow, whose `draft_prefix` lists the drafts before it)."""

    sampling: Sampling
    token_ids: list[int]
    num_generated: int
    constraint: RowConstraint | None


def ensure_constraint(st: ConstrainedSequence, vocabulary: GuidanceVocabulary | None) -> RowConstraint:
    """The sequence's matcher, built at its first constrained step on this worker."""
    if st.constraint is None:
        if vocabulary is None:
            raise ValueError("constrained rows need llguidance's vocabulary (GuidanceVocabulary)")
        st.constraint = build_row_constraint(st.sampling.constraint, st.token_ids, st.num_generated,  # type: ignore[arg-type]
                                             vocabulary)
    return st.constraint


def advance_drafted(rc: RowConstraint, kept: list[int]) -> None:
    """A drafted sequence's matcher consumes the tokens the sequence kept after verification, up to its EOS: the
    rows past a kept EOS were sampled unmasked, and the scheduler ends the sample at that EOS (a constrained
    sample cannot ignore it)."""
    for token in kept:
        if rc.error or rc.matcher.is_stopped():
            return
        if not rc.matcher.consume_token(token):
            rc.fail(f"token {token} was refused: {rc.matcher.get_error()}")


def _fill_mask(rc: RowConstraint, prefix: list[int] | None, word: torch.Tensor) -> bool:
    """The row's mask into `word` (llguidance.torch's fill_next_token_bitmask, without importing torch.compile),
    after the drafts in `prefix`; False when the grammar refuses one of them (the row is never reached)."""
    consumed = rc.matcher.try_consume_tokens(prefix) if prefix else 0
    if prefix and consumed < len(prefix):
        rc.matcher.rollback(consumed)
        return False
    rc.matcher.unsafe_compute_mask_ptr(word.data_ptr(), word.numel() * word.element_size())
    if consumed:
        rc.matcher.rollback(consumed)
    return True


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """int32 [R, W] (bit b of word w allows token 32w + b) -> bool [R, width]; ids past the mask are not
    allowed (the model's vocabulary may be wider than the tokenizer's). numpy's unpackbits over the
    little-endian bytes: about 15x faster than shifting in torch (5 us per row of 49,152 ids)."""
    bits = torch.from_numpy(np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")).view(torch.bool)
    if bits.shape[1] >= width:
        return bits[:, :width]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], width - bits.shape[1])], dim=1)


@dataclass
class ConstraintMasks:
    """One step's constrained rows: `rows` (batch rows) and `allowed` (bool [R, V]: tokens each may take)."""

    rows: torch.Tensor  # int64 [R]
    allowed: torch.Tensor  # bool [R, V]
    row_states: list[tuple[int, RowConstraint]] = field(default_factory=list)  # (batch row, its matcher)
    drafted_rows: frozenset[int] = frozenset()  # rows of drafted sequences: advanced after verification

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with every disallowed token of the constrained rows at -inf (a new tensor: the input
        may be the model's own logits, whose logprobs are returned)."""
        sub = logits.index_select(0, self.rows).masked_fill_(~self.allowed, float("-inf"))
        return logits.index_copy(0, self.rows, sub)

    def advance(self, token_ids: list[int]) -> list[tuple[int, str]]:
        """Each matcher consumes its row's token; returns (batch row, error) of the samples that failed."""
        failed = []
        for row, rc in self.row_states:
            if row in self.drafted_rows:
                continue
            if not rc.error and not rc.matcher.consume_token(token_ids[row]):
                rc.fail(f"token {token_ids[row]} was refused: {rc.matcher.get_error()}")
            if rc.error:
                failed.append((row, rc.error))
        return failed


def build_constraint_masks(states: Sequence[ConstrainedSequence], candidates: Sequence[int], width: int,
                           vocabulary: GuidanceVocabulary | None, device: torch.device) -> ConstraintMasks | None:
    """The masks of the rows among `candidates` that carry a constraint, or None when none does. `width`:
    the logits' width. A row whose matcher failed, or that would have no token left, is marked failed
    and allowed every token (reported in StepResult.failures after sampling)."""
    rows = [i for i in candidates if states[i].sampling.constraint is not None]
    if not rows:
        return None
    if vocabulary is None:  # a caller that forgot it must not sample constrained rows unconstrained
        raise ValueError("constrained rows need llguidance's vocabulary (GuidanceVocabulary)")
    row_states = [(i, ensure_constraint(states[i], vocabulary)) for i in rows]
    prefixes = [getattr(states[i], "draft_prefix", None) for i in rows]
    tokenizer = vocabulary.tokenizer
    words = (tokenizer.vocab_size + 31) // 32 if tokenizer is not None else (width + 31) // 32
    bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
    unreached = set()  # drafted rows past a draft the grammar refuses
    for j, (_, rc) in enumerate(row_states):
        if not rc.error:
            if not _fill_mask(rc, prefixes[j], bitmask[j]):
                unreached.add(j)
            if rc.matcher.is_error():
                rc.fail(f"computing the token mask failed: {rc.matcher.get_error()}")
    allowed = unpack_bitmask(bitmask, width)
    any_allowed = allowed.any(dim=1).tolist()
    for j, (_, rc) in enumerate(row_states):
        if prefixes[j] and (j in unreached or not any_allowed[j]):  # a draft row past a refused draft or the end
            allowed[j] = True
            continue
        if not rc.error and not any_allowed[j]:
            rc.fail(f"no token of the model's vocabulary ({width} ids) can continue the constraint")
        if rc.error:
            allowed[j] = True  # sample anything: the row's token is replaced by the failure marker
    drafted = frozenset(i for i, prefix in zip(rows, prefixes) if prefix is not None)
    return ConstraintMasks(rows=torch.tensor(rows, dtype=torch.int64).to(device), allowed=allowed.to(device),
                           row_states=row_states, drafted_rows=drafted)
