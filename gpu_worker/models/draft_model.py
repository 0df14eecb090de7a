"""The draft model of speculative decoding (config `speculative_method: draft`, `speculative_model`; the
scheduler's side: scheduler_svc/speculation/speculation.py, the verification: draft_rows.py).

A smaller model with the served model's tokenizer runs in the same worker and proposes, greedily, the
tokens the plan asks for (ScheduledSequence.num_draft_model_tokens); the step then scores them as it scores
n-gram drafts, so outputs are those of the served model alone whatever the draft proposes.

Its K/V lives in its own cache tensor laid out in the same blocks as the served model's: a sequence's block
table addresses both, so the scheduler's pool owns and frees the draft's K/V with the sequence's (each block's
bytes count both when the pool is sized), copy-on-write copies both, and a rejected draft's slots are simply
overwritten later. What the draft's cache holds is tracked per sequence (`draft_computed`). When a sequence
is asked for drafts, before the served model runs, the draft model first computes its confirmed tokens that
its cache lacks (the prompt at its first drafted decode, the tokens of decodes that carried no drafts, a
kept draft it did not see, and at least the last token), whose last row proposes d_1, all such sequences in
one pass; then one token per pass proposes d_2..d_k (their K/V written where the sequence's next tokens go,
and kept if the served model keeps them). A sequence that does not draft costs the draft model nothing.
A constrained sample's proposals follow its grammar: each is masked by the matcher's state after the drafts
before it (gpu_worker/sampling/constrained.py), as the served model's rows will be.

Draft K/V that is lost (swapped out, suspended) is recomputed from the tokens, as is a new sequence's whole
prompt (prefix-cache hits are not trusted: the blocks may have been computed by sequences that never
drafted). With tensor parallelism every rank runs the whole draft model and takes rank 0's proposals.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import structlog
import torch

from gpu_worker.kv_dtype import kv_cache_torch_dtype
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.checkpoint import load_checkpoint
from gpu_worker.models.model_build import build_model
from gpu_worker.parallel.tensor_parallel import TensorParallel
from gpu_worker.sampling.constrained import GuidanceVocabulary, RowConstraint, build_constraint_masks, ensure_constraint
from gpu_worker.sampling.draft_rows import DraftRow
from hetero.v1 import worker_pb2
from hetero_common.config import Config
from hetero_common.errors import ConfigError
from hetero_common.sampling import Sampling
from kernels.attention_backend import create_attention_backend
from kernels.cache_ops import allocate_kv_cache, copy_blocks, kv_row_bytes
from kernels.page_table import PageTable

log = structlog.get_logger("gpu_worker.models.draft_model")


class DraftedSequence(Protocol):  # runner.SequenceState's fields used here
    token_ids: list[int]
    sampling: Sampling
    num_generated: int
    num_computed: int
    block_table: np.ndarray
    constraint: RowConstraint | None
    draft_computed: int  # tokens whose draft K/V is in the cache


class DraftModel:
    """The draft model, its K/V cache (allocated once the served model's pool is sized) and its proposals."""

    def __init__(self, config: Config, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                 max_positions: int) -> None:
        path = Path(config.speculative_model)
        if not path.exists():
            raise ConfigError(f"config key 'speculative_model' = {config.speculative_model!r}: no such file or "
                              "directory; give a model directory (HF safetensors) or a .gguf file")
        self.model_config, weights = load_checkpoint(path)
        self.model, _ = build_model(config, self.model_config, weights, device, dtype, max_positions, TensorParallel())
        del weights
        mc = self.model_config
        # Proposals are ids of the served vocabulary: a draft padded wider never proposes past it.
        self.vocab_size = min(mc.vocab_size, target.vocab_size)
        if mc.vocab_size != target.vocab_size:
            log.warning("the draft model's vocabulary differs from the served model's; it must share its tokenizer",
                        draft_vocab=mc.vocab_size, served_vocab=target.vocab_size)
        self.device, self.block_size = device, config.block_size
        self.kv_dtype = kv_cache_torch_dtype(config, dtype, device, mc.head_dim)
        self.bytes_per_block = (mc.num_hidden_layers * 2 * self.block_size * self.model.num_kv_heads
                                * kv_row_bytes(self.kv_dtype, mc.head_dim))
        self.attention = create_attention_backend(config.attention_backend, self.model.num_heads,
                                                  self.model.num_kv_heads, mc.head_dim, device, dtype=dtype,
                                                  kv_dtype=self.kv_dtype, scale=mc.attention_scale)
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = 0
        log.info("draft model loaded", model=str(path), layers=mc.num_hidden_layers, hidden_size=mc.hidden_size,
                 kv_bytes_per_block=self.bytes_per_block)

    def allocate(self, num_blocks: int) -> None:
        """Its K/V cache, in as many blocks as the served model's."""
        mc = self.model_config
        self.num_blocks = num_blocks
        self.kv_cache = allocate_kv_cache(mc.num_hidden_layers, num_blocks, self.block_size, self.model.num_kv_heads,
                                          mc.head_dim, self.kv_dtype, self.device, self.attention.kv_layout)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: the draft's K/V of the copied blocks too."""
        if self.kv_cache is not None:
            copy_blocks(self.kv_cache, src, dst)

    def suspend(self, mode: str) -> None:
        """The served model's cache is suspended: `offload` and `recompute` release the draft's (it is
        recomputed from the tokens after `resume`), `persist` keeps it."""
        if mode in ("offload", "recompute"):
            self.kv_cache = None

    def resume(self, sequences: Iterable[DraftedSequence]) -> None:
        if self.kv_cache is None:
            self.allocate(self.num_blocks)
            for st in sequences:
                st.draft_computed = 0

    @torch.inference_mode()
    def propose(self, entries: Sequence[worker_pb2.ScheduledSequence], states: Sequence[DraftedSequence],
                ends: Sequence[int], tp: TensorParallel,
                vocabulary: GuidanceVocabulary | None = None) -> tuple[float, float]:
        """Each entry's draft_token_ids, as many as its num_draft_model_tokens (`ends`: each sequence's computed
        length after the step, the drafts included; its block table already holds their slots). `vocabulary`:
        llguidance's (constrained samples). Returns (the seconds it took, those that proposing alone takes once
        the draft has caught up: StepResult.draft_seconds and draft_proposal_seconds)."""
        asked = [s.num_draft_model_tokens for s in entries]
        if not any(asked):
            return 0.0, 0.0
        started = time.perf_counter()
        confirmed = [end - k for end, k in zip(ends, asked)]
        drafts, caught_up = self._catch_up(states, confirmed, asked, vocabulary)
        first_pass, passes = time.perf_counter() - started, []
        for j in range(1, max(asked, default=0)):  # d_{j+1} from d_j, one token per sequence
            began = time.perf_counter()
            active = [i for i, k in enumerate(asked) if k > j]
            table = PageTable.build([states[i].block_table for i in active], np.ones(len(active), dtype=np.int64),
                                    np.asarray([confirmed[i] + j for i in active]), self.block_size)
            rows = [self._row(states[i], drafts[i], vocabulary) for i in active]
            tokens = self._propose_from(table, np.asarray([drafts[i][-1] for i in active]), list(range(len(active))),
                                        rows, vocabulary)
            for i, t in zip(active, tokens):
                drafts[i].append(t)
            passes.append(time.perf_counter() - began)
        flat = [t for i in range(len(entries)) for t in drafts.get(i, ())]
        if tp.enabled and flat:  # every rank verifies rank 0's proposals
            flat = tp.broadcast_tokens(torch.tensor(flat, dtype=torch.int64, device=self.device)).tolist()
        start = 0
        for i, (entry, state) in enumerate(zip(entries, states)):
            if asked[i]:
                entry.draft_token_ids.extend(flat[start:start + asked[i]])
                start += asked[i]
                # d_1..d_{k-1} went in as inputs: their K/V counts once the served model keeps them
                state.draft_computed = confirmed[i] + asked[i] - 1
        if caught_up:  # the first pass also computed prompts or lagging tokens: counted as a one-token pass
            first_pass = sum(passes) / len(passes) if passes else first_pass / caught_up
        return time.perf_counter() - started, first_pass + sum(passes)

    def _catch_up(self, states: Sequence[DraftedSequence], confirmed: list[int], asked: list[int],
                  vocabulary: GuidanceVocabulary | None) -> tuple[dict[int, list[int]], float]:
        """The first pass, over the sequences asked for drafts: the confirmed tokens the draft's cache lacks,
        their last one at least. Returns (d_1 of each, by index; when it computed more than 2 tokens a sequence,
        how many times a one-token pass's tokens it computed, else 0)."""
        asking = [i for i, k in enumerate(asked) if k]
        if not asking:
            return {}, 0.0
        starts = []
        for i in asking:
            st = states[i]
            # what the draft holds, no more than what the served model holds (it keeps only accepted drafts),
            # and at least the last token, whose logits propose d_1
            starts.append(min(st.draft_computed, st.num_computed, confirmed[i] - 1))
            st.draft_computed = confirmed[i]
        table = PageTable.build([states[i].block_table for i in asking],
                                np.asarray([confirmed[i] - start for i, start in zip(asking, starts)]),
                                np.asarray([confirmed[i] for i in asking]), self.block_size)
        flat = np.fromiter((t for i, start in zip(asking, starts) for t in states[i].token_ids[start:confirmed[i]]),
                           dtype=np.int64, count=table.num_tokens)
        last_rows = (table.qo_indptr[1:].to(torch.int64) - 1).tolist()
        rows = [self._row(states[i], [], vocabulary) for i in asking]
        first = self._propose_from(table, flat, last_rows, rows, vocabulary)
        caught_up = table.num_tokens / len(asking) if table.num_tokens > 2 * len(asking) else 0.0
        return {i: [t] for i, t in zip(asking, first)}, caught_up

    @staticmethod
    def _row(st: DraftedSequence, prefix: list[int], vocabulary: GuidanceVocabulary | None) -> DraftRow:
        """The sampler's view of a sequence after the drafts `prefix` (its grammar's state: draft_rows.DraftRow)."""
        constraint = ensure_constraint(st, vocabulary) if st.sampling.constraint is not None else None
        return DraftRow(st.sampling, st.token_ids, st.num_generated + len(prefix), None, constraint, list(prefix))

    def _propose_from(self, table: PageTable, token_ids: np.ndarray, picked: list[int], rows: list[DraftRow],
                      vocabulary: GuidanceVocabulary | None) -> list[int]:
        """One forward of the draft model over `table`'s tokens (their K/V written into its cache); the greedy
        next token after each of the `picked` rows, within its grammar where `rows` has one."""
        positions, slots = table.token_positions()
        self.attention.plan(table)
        hidden = self.model.hidden_states(
            torch.from_numpy(token_ids).to(self.device), torch.from_numpy(positions).to(self.device),
            torch.from_numpy(slots).to(self.device), self.kv_cache, self.attention)
        if not picked:
            return []
        logits = self.model.logits(hidden[torch.tensor(picked, device=self.device)])[:, :self.vocab_size]
        constrained = [i for i, row in enumerate(rows) if row.sampling.constraint is not None]
        if constrained:
            masks = build_constraint_masks(rows, constrained, self.vocab_size, vocabulary, self.device)
            logits = masks.apply(logits.float()) if masks is not None else logits
        return logits.argmax(dim=-1).tolist()
