"""The model runner: per-sequence state on the worker and one `execute(StepPlan)` per step.

The worker keeps each sequence's token ids and block table, updated from the plan's
diffs (new sequences once, then appended block ids and a token count). It trusts the
block tables, writes K/V into the paged cache, runs the model once over every scheduled
token, samples, and returns the sampled token ids.
"""

from __future__ import annotations

import os
import time

import numpy as np
import structlog
import torch

from gpu_worker.cpu.gguf_serving import gguf_blocks_kept
from gpu_worker.cpu.worker_setup import (
    allocate_cpu_kv_cache,
    choose_cpu_dtype,
    configure_cpu_threads,
    row_invariance_unavailable,
)
from gpu_worker.cuda.cuda_graphs import DecodeGraphs
from gpu_worker.cuda.cuda_setup import prepare_cuda_worker
from gpu_worker.kv_dtype import kv_cache_torch_dtype
from gpu_worker.kv_suspension import KVSuspension
from gpu_worker.lora.lora_slots import load_lora_slots
from gpu_worker.models.checkpoint import load_checkpoint
from gpu_worker.models.draft_model import DraftModel
from gpu_worker.models.model_build import build_model, resolve_device, resolve_dtype
from gpu_worker.parallel.tensor_parallel import TensorParallel
from gpu_worker.pooling import PoolingEntry, pool
from gpu_worker.sampling import draft_rows
from gpu_worker.sampling.constrained import GuidanceVocabulary
from gpu_worker.sampling.prompt_logprobs import PromptSpan, prompt_span, score, wanted
from gpu_worker.sampling.sampler import build_sampling_batch, sample
from gpu_worker.step_io import SampledTokens, SequenceState, StepInputs, pack_samples
from hetero.v1 import worker_pb2
from hetero_common.config import Config
from hetero_common.device_defaults import step_batch_size
from hetero_common.errors import ConfigError, ExecutionError
from hetero_common.model_files import resolve_model_path
from hetero_common.sampling import resolve
from kernels.cache_ops import copy_blocks, kv_row_bytes, swap_in_blocks, swap_out_blocks
from kernels.page_table import PageTable

log = structlog.get_logger("gpu_worker.runner")


class ModelRunner:
    def __init__(self, config: Config, tp: TensorParallel = TensorParallel()) -> None:
        self.config = config
        self.tp = tp
        self.device = resolve_device(config.device)
        threads = 0
        if self.device.type == "cpu":  # every worker process on this host (replicas x ranks) shares the cores
            threads = configure_cpu_threads(config.num_threads, config.data_parallel_size, tp.size, config.reserved_cpus)
        self.model_path = resolve_model_path(config.model)
        started = time.perf_counter()
        self.model_config, weights = load_checkpoint(self.model_path, keep_blocks=gguf_blocks_kept(config, self.device, tp))
        self.dtype = self._choose_dtype(threads)
        self.block_size = config.block_size
        self.max_positions = min(config.max_model_len, self.model_config.max_position_embeddings)
        self.model, self.c_linear = build_model(config, self.model_config, weights, self.device, self.dtype,
                                                self.max_positions, tp)
        del weights  # the checkpoint's tensors go before the KV cache is sized (the model keeps what it uses)
        self.kv_dtype = kv_cache_torch_dtype(config, self.dtype, self.device, self.model_config.head_dim)
        row = kv_row_bytes(self.kv_dtype, self.model_config.head_dim)  # fp8: half bfloat16's, so twice the blocks
        self.bytes_per_block = (self.model_config.num_hidden_layers * 2 * self.block_size * self.model.num_kv_heads
                                * row)  # this rank's share of the KV heads
        self.drafter = (DraftModel(config, self.model_config, self.device, self.dtype, self.max_positions)
                        if config.speculative_method == "draft" else None)
        self.bytes_per_block += self.drafter.bytes_per_block if self.drafter is not None else 0  # sized together
        self.graphs: DecodeGraphs | None = None
        self._suspension = KVSuspension()  # the KV cache while suspended (kv_suspension.py)
        if self.device.type == "cuda":  # the KV cache is sized from free memory after a warm-up pass
            self._prepare_cuda()
        else:
            if config.static_kv_memory_pointers:
                raise ConfigError("config key 'static_kv_memory_pointers' = True keeps the KV cache's CUDA addresses "
                                  "for the decode graphs; the CPU worker has neither: set it to false")
            self.num_blocks, self.attention, self.kv_cache = allocate_cpu_kv_cache(
                config, self.model, self.model_config.head_dim, self.kv_dtype, self.bytes_per_block, self._agree)
        if self.drafter is not None:  # its K/V in as many blocks
            self.drafter.allocate(self.num_blocks)
        self.loras = load_lora_slots(config, self.model_config, self.device, self.dtype, tp)
        # llguidance's tokenizer of the served vocabulary, built at the first constrained request.
        self.vocabulary = GuidanceVocabulary(self._tokenizer_json, self.model_config.eos_token_ids,
                                             self.model_config.vocab_size)
        self.sequences: dict[int, SequenceState] = {}
        self.swapped: dict[int, torch.Tensor] = {}  # seq id -> its blocks in host memory (preemption by swap)
        self.steps = 0
        self._log_loaded(started)

    # ------------------------------------------------------------------ start-up

    def _choose_dtype(self, threads: int) -> torch.dtype:
        """The config's dtype, `auto` resolved (on a CPU: rank 0's choice for every rank, logged)."""
        if self.device.type == "cpu":
            return choose_cpu_dtype(self.config, self.model_config.hidden_size, self.tp, threads)
        return resolve_dtype(self.config.dtype, self.device)

    def _prepare_cuda(self) -> None:
        """The attention backend, the KV cache sized from the memory left after a warm-up pass, the decode graphs."""
        cuda = prepare_cuda_worker(self.model, self.config, self.device, self.dtype, self.kv_dtype, self.block_size,
                                   self.bytes_per_block, self.max_positions, self._agree)
        self.num_blocks, self.kv_cache, self.attention, self.graphs = (cuda.num_blocks, cuda.kv_cache,
                                                                       cuda.attention, cuda.graphs)
        self._suspension = KVSuspension(cuda.static_memory)

    def _agree(self, own_blocks: int) -> int:
        """The KV block count of every rank of this replica (the smallest any rank can hold)."""
        return self.tp.agreed_kv_blocks(own_blocks, self.device)

    def _log_loaded(self, started: float) -> None:
        mc = self.model_config
        log.info("model loaded", model=str(self.model_path), architecture=mc.architecture, device=str(self.device),
                 dtype=str(self.dtype).removeprefix("torch."), kv_blocks=self.num_blocks,
                 kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
                 c_decode_attention=getattr(self.attention, "native_decode", False) and self.dtype == torch.bfloat16,
                 elementwise=self.model.elementwise, c_linear=self.c_linear, row_invariant=self._row_invariant(),
                 kv_cache_mib=round(self.num_blocks * self.bytes_per_block / 2**20, 1),
                 max_num_blocks=self.config.max_num_blocks or "unset: the device's",
                 **dict(zip(("max_batch_size", "max_batch_size_from"),
                            step_batch_size(self.config, self.device.type, self.num_blocks))),
                 load_seconds=round(time.perf_counter() - started, 2))

    def _row_invariant(self) -> bool:
        """Whether a token's values are the same bits on every scheduling path (config `deterministic`): on the
        CPU, float32's torch code, or bfloat16 where the C kernels take every row (not yet a sliding window's:
        those layers attend through the torch code)."""
        if self.device.type != "cpu":
            return False
        if self.dtype == torch.float32:
            return True
        return (self.config.deterministic and self.dtype == torch.bfloat16 and self.c_linear
                and getattr(self.attention, "native_decode", False) and not self.model_config.sliding_layers
                and row_invariance_unavailable(self.model_config.head_dim, self.block_size) is None)

    def _tokenizer_json(self) -> str:
        """The served tokenizer as `tokenizers` JSON, loaded as the gateway loads it (the same config keys), so
        the worker's matchers and the gateway's validation see one vocabulary."""
        from hetero_common.tokenizer import load_tokenizer  # lazily: only a constrained request needs it

        tk = self.config.tokenizer
        return load_tokenizer(self.model_path, tk.path, kind=tk.kind).tokenizer.to_str()

    def describe(self) -> worker_pb2.WorkerInfo:
        mc = self.model_config
        return worker_pb2.WorkerInfo(
            model_name=self.config.serving.model_name, architecture=mc.architecture, vocab_size=mc.vocab_size,
            num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
            max_position_embeddings=mc.max_position_embeddings, eos_token_ids=list(mc.eos_token_ids),
            block_size=self.block_size, num_blocks=self.num_blocks, device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."), attention_backend=self.attention.name,
            kv_cache_bytes=self.num_blocks * self.bytes_per_block * self.tp.size,
            max_batch_size=step_batch_size(self.config, self.device.type, self.num_blocks)[0],
            pid=os.getpid(), tensor_parallel_size=self.tp.size, lora_adapters=self.loras.loaded(),
            num_experts=mc.moe.num_experts if mc.moe else 0, num_experts_per_tok=mc.moe.top_k if mc.moe else 0,
        )

    def _apply_diffs(self, plan: worker_pb2.StepPlan) -> None:
        # The order is the contract's (worker.proto, StepPlan): reset, released, swap_out, swap_in, copies, new.
        if plan.reset:
            self.sequences.clear()
            self.swapped.clear()
            if self._suspension.mode:  # a new scheduler, which knows nothing of the suspend, owns this worker now
                self.resume_kv_cache()
        if self._suspension.mode:
            raise ExecutionError(f"step {plan.step_id}: the KV cache is suspended; call ResumeKVCache first")
        for seq_id in plan.released_seq_ids:
            self.sequences.pop(seq_id, None)
            self.swapped.pop(seq_id, None)
        for swap in plan.swap_out:
            state = self._state(plan, swap.seq_id)
            self.swapped[swap.seq_id] = swap_out_blocks(self.kv_cache, torch.tensor(list(swap.block_ids), device=self.device),
                                                        self.config.pin_memory)
            state.block_table = np.zeros(0, dtype=np.int32)
        for swap in plan.swap_in:
            state, host = self._state(plan, swap.seq_id), self.swapped.pop(swap.seq_id, None)
            if host is None or host.shape[1] != len(swap.block_ids):
                raise ExecutionError(f"step {plan.step_id}: sequence {swap.seq_id} has no swapped blocks of that count")
            swap_in_blocks(self.kv_cache, host, torch.tensor(list(swap.block_ids), device=self.device))
            state.block_table = np.asarray(swap.block_ids, dtype=np.int32)
            state.draft_computed = 0  # the draft model's K/V stayed behind (draft_model.py)
        if plan.block_copies:
            src = torch.tensor([c.src for c in plan.block_copies], device=self.device)
            dst = torch.tensor([c.dst for c in plan.block_copies], device=self.device)
            copy_blocks(self.kv_cache, src, dst)
            if self.drafter is not None:
                self.drafter.copy_blocks(src, dst)
        for new in plan.new_sequences:
            if new.lora_slot and not self.loras.has(new.lora_slot):
                raise ExecutionError(f"step {plan.step_id}: sequence {new.seq_id} asks for LoRA slot {new.lora_slot}, "
                                     "which holds no adapter on this worker")
            self.sequences[new.seq_id] = SequenceState(list(new.token_ids), resolve(new.params), new.num_generated,
                                                       prompt_logprobs=wanted(new.params, new.num_generated),
                                                       lora_slot=new.lora_slot, pooling=new.pooling)

    def _state(self, plan: worker_pb2.StepPlan, seq_id: int) -> SequenceState:
        state = self.sequences.get(seq_id)
        if state is None:
            raise ExecutionError(f"step {plan.step_id}: sequence {seq_id} is unknown to this worker")
        return state

    # ------------------------------------------------------------------ suspend / resume

    def suspend_kv_cache(self, mode: str) -> int:
        """Release the KV cache's device memory: `persist` keeps it, `offload` moves it to host
        memory, `recompute` drops it (the scheduler re-queues its sequences). Returns bytes released."""
        if self._suspension.mode:
            return 0
        self.kv_cache, released = self._suspension.suspend(mode, self.kv_cache, self.graphs is not None)
        if self.drafter is not None:
            self.drafter.suspend(mode)
        if self._suspension.recapture_graphs:  # they captured the cache's address: captured again on resume
            self.graphs = None
        if released and self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("kv cache suspended", mode=mode, released_bytes=released)
        return released

    def resume_kv_cache(self) -> None:
        self.kv_cache, mode = self._suspension.resume(self.kv_cache)
        if self.drafter is not None:
            self.drafter.resume(self.sequences.values())
        if mode in ("offload", "recompute") and self._suspension.recapture_graphs:
            from gpu_worker.cuda.cuda_setup import capture_decode_graphs

            self.graphs = capture_decode_graphs(self.model, self.attention, self.kv_cache, self.config,
                                                self.kv_cache.shape[1] - 1, self.block_size, self.max_positions)
        log.info("kv cache resumed", mode=mode or "none")

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        started = time.perf_counter()
        self._apply_diffs(plan)
        result = worker_pb2.StepResult(step_id=plan.step_id)
        if not plan.scheduled:
            return result
        step = self._prepare(plan)
        logits = self._run_model(step, result)
        if (load := self.model.take_expert_load()) is not None:  # a mixture of experts' (not on a graph replay)
            result.expert_tokens.extend(load.tolist())
        for state, n in zip(step.states, step.qo_lens):  # their K/V is in the cache now
            state.num_computed += n
        if step.sample_idx:
            sampled = self._sample(step, logits)
            pack_samples(plan, step, sampled, logits, result)
        self.steps += 1
        result.forward_seconds = time.perf_counter() - started
        result.draft_seconds, result.draft_proposal_seconds = step.draft_seconds
        return result

    def _prepare(self, plan: worker_pb2.StepPlan) -> StepInputs:
        """The step's flattened inputs: each scheduled sequence's block table brought up to the plan, the
        tokens it computes, the prompt positions it scores, and the page table over them all."""
        states: list[SequenceState] = []
        tables, qo_lens, kv_lens, inputs = [], [], [], []
        spans: list[PromptSpan] = []  # prompt positions whose logprobs are asked for
        pooled: list[PoolingEntry] = []  # embedding sequences: pooled, never sampled
        row_offset = 0  # this sequence's first row in the step's flattened tokens (the sum of qo_lens so far)
        drafted: dict[int, list[int]] = {}  # plan index -> the entry's speculative drafts (draft_rows.py)
        updated = [self._update_sequence(plan, s) for s in plan.scheduled]
        draft_seconds = (0.0, 0.0) if self.drafter is None else self.drafter.propose(  # into the entries that ask for them
            plan.scheduled, [st for st, _ in updated], [end for _, end in updated], self.tp, self.vocabulary)
        for s, (state, end) in zip(plan.scheduled, updated):
            if state.prompt_logprobs is not None:
                span = prompt_span(s.seq_id, state.prompt_logprobs, state.token_ids, state.num_generated,
                                   state.num_computed, s.num_tokens, row_offset)
                if span is None:  # the prompt is scored (chunks come in order): nothing more to look at
                    state.prompt_logprobs = None
                else:
                    spans.append(span)
            chunk = state.token_ids[state.num_computed:end]
            if s.draft_token_ids:  # computed after the last token; the plan's count includes them
                draft_rows.check_drafts(s.seq_id, s.sample, s.draft_token_ids, end, len(state.token_ids))
                drafted[len(states)] = list(s.draft_token_ids)
                chunk = chunk + drafted[len(states)]
            if state.pooling:
                pooled.append(PoolingEntry(s.seq_id, state, row_offset, state.num_computed, s.num_tokens, s.sample))
            inputs.append(chunk)
            states.append(state)
            tables.append(state.block_table)
            qo_lens.append(s.num_tokens)
            row_offset += s.num_tokens
            kv_lens.append(end)
        table = PageTable.build(tables, np.asarray(qo_lens), np.asarray(kv_lens), self.block_size)
        positions, slots = table.token_positions()
        if table.num_tokens and int(positions.max()) >= self.max_positions:  # checked here, on the host: CUDA's
            # RoPE table lookup is unchecked, and a device-side assert there ends the process's CUDA context
            raise ExecutionError(f"step {plan.step_id}: position {int(positions.max())} is beyond the model's "
                                 f"{self.max_positions} positions (max_model_len)")
        sample_idx = [i for i, s in enumerate(plan.scheduled) if s.sample and not states[i].pooling]
        flat_inputs = np.fromiter((t for chunk in inputs for t in chunk), dtype=np.int64, count=table.num_tokens)
        drafts = [drafted.get(i, []) for i in sample_idx] if drafted else None
        rows, starts = (draft_rows.logits_rows(table.qo_indptr, sample_idx, drafts) if drafts is not None
                        else (table.qo_indptr[1:].to(torch.int64)[sample_idx] - 1, None))
        return StepInputs(states, qo_lens, spans, table, positions, slots, flat_inputs, sample_idx, rows, drafts, starts,
                          draft_seconds, pooled)

    def _update_sequence(self, plan: worker_pb2.StepPlan,
                         s: worker_pb2.ScheduledSequence) -> tuple[SequenceState, int]:
        """(the sequence's state, its computed length after this step), its block table updated from the plan
        and the plan checked against what this worker knows of it."""
        state = self._state(plan, s.seq_id)
        if s.block_table_edits:  # copy-on-write: the copies were made in _apply_diffs
            state.block_table = state.block_table.copy()
            for edit in s.block_table_edits:
                state.block_table[edit.index] = edit.block_id
        if s.new_block_ids:
            state.block_table = np.concatenate([state.block_table, np.asarray(s.new_block_ids, dtype=np.int32)])
        if state.num_computed < 0:  # new: the leading tokens came from the prefix cache
            state.num_computed = s.num_cached_tokens
        if s.num_cached_tokens != state.num_computed:
            raise ExecutionError(f"step {plan.step_id}: sequence {s.seq_id} has {state.num_computed} cached tokens, "
                                 f"the plan says {s.num_cached_tokens}")
        end = state.num_computed + s.num_tokens
        drafts = len(s.draft_token_ids) + (s.num_draft_model_tokens if self.drafter is not None else 0)
        if end > len(state.token_ids) + drafts or end > len(state.block_table) * self.block_size:
            raise ExecutionError(f"step {plan.step_id}: sequence {s.seq_id} cannot compute tokens up to {end} "
                                 f"({len(state.token_ids)} known, {len(state.block_table)} blocks)")
        return state, end

    def _run_model(self, step: StepInputs, result: worker_pb2.StepResult) -> torch.Tensor:
        """The sampled rows' logits: a CUDA graph's replay for a decode-only step that one fits, else an eager
        forward, which also scores the asked-for prompt positions and pools the embedding sequences' rows
        (into `result`, on rank 0)."""
        lora = self.loras.batch(np.repeat([st.lora_slot for st in step.states], step.qo_lens))
        if (self.graphs is not None and not step.spans and not step.pooled and lora is None
                and self.graphs.can_run(step.table)):
            logits = self.graphs.run(step.table, step.flat_inputs, step.positions)  # a row per sequence, in order
            if len(step.sample_idx) == logits.shape[0]:  # every one samples: no gather, no index copied to the device
                step.graph_greedy = self.graphs.greedy_tokens()
                return logits
            return logits[step.logits_rows.to(self.device)]
        self.attention.plan(step.table)
        hidden = self.model.hidden_states(
            torch.from_numpy(step.flat_inputs).to(self.device), torch.from_numpy(step.positions).to(self.device),
            torch.from_numpy(step.slots).to(self.device), self.kv_cache, self.attention, lora)
        if self.tp.rank == 0:  # only rank 0's result goes back
            if step.spans:
                result.prompt_logprobs.extend(score(self.model, hidden, step.spans))
            if step.pooled:
                result.embeddings.extend(pool(self.model, hidden, step.pooled))
        if not step.sample_idx:  # embeddings alone: no row reaches the LM head
            return hidden[:0]
        return self.model.logits(hidden[step.logits_rows.to(self.device)])

    def _sample(self, step: StepInputs, logits: torch.Tensor) -> SampledTokens:
        """The sampling sequences' next tokens (rank 0's on every rank), appended to them."""
        sampled = [step.states[i] for i in step.sample_idx]
        eos, vocab = self.model_config.eos_token_ids, logits.shape[-1]  # a drafted sequence: one row per position
        rows = (sampled if step.drafts is None
                else draft_rows.expand(sampled, step.drafts, vocab, eos, self.device, self.vocabulary))
        batch = build_sampling_batch(rows, vocab, eos, self.device, self.vocabulary)
        if step.graph_greedy is not None and step.drafts is None and batch.plain_greedy:
            tokens, logprobs = step.graph_greedy, None  # what `sample` would return, taken in the graph
        else:
            tokens, logprobs = sample(logits, batch)
        tokens = self.tp.broadcast_tokens(tokens)  # every rank appends rank 0's choice
        token_list = tokens.tolist()
        failures = batch.record(token_list)  # a failed constraint: the scheduler fails that sample alone
        if step.drafts is not None and step.row_starts is not None:  # rows to sequences, drafts kept or not
            drafted = draft_rows.settle(sampled, step.drafts, step.row_starts, token_list, self.block_size)  # type: ignore[arg-type]
            failures = [(draft_rows.sequence_of_row(step.row_starts, row), error)
                        for row, error in failures] + drafted.failures
            return SampledTokens(sampled, drafted.token_ids, logprobs, failures, drafted)
        for st, tok in zip(sampled, token_list):
            st.token_ids.append(tok)
            st.num_generated += 1
        return SampledTokens(sampled, token_list, logprobs, failures)
