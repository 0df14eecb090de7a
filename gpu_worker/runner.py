"""The model runner: per-sequence state on the worker and one `execute(StepPlan)` per step.

The worker keeps each sequence's token ids and block table, updated from the plan's
diffs (new sequences once, then appended block ids and a token count). It trusts the
block tables, writes K/V into the paged cache, runs the model once over every scheduled
token, samples, and returns the sampled token ids.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch

from gpu_worker.checkpoint import ModelConfig, load_checkpoint
from gpu_worker.constrained import GuidanceVocabulary, RowConstraint
from gpu_worker.cpu.packed_linear import prepack_supported
from gpu_worker.cpu.worker_setup import configure_cpu_threads, cpu_flags, resolve_cpu_dtype
from gpu_worker.cuda_graphs import DecodeGraphs
from gpu_worker.cuda_setup import prepare_cuda_worker
from gpu_worker.model import LlamaModel, linear_shapes
from gpu_worker.logits_processors import RowControls
from gpu_worker.prompt_logprobs import PromptSpan, prompt_span, score, wanted
from gpu_worker.sampler import build_sampling_batch, sample, top_logprobs
from gpu_worker.tensor_parallel import TensorParallel
from hetero.v1 import worker_pb2
from hetero_common.config import Config
from hetero_common.errors import ExecutionError
from hetero_common.model_files import resolve_model_path
from hetero_common.sampling import Sampling, resolve
from kernels.attention_backend import create_attention_backend
from kernels.cache_ops import allocate_kv_cache, copy_blocks, swap_in_blocks, swap_out_blocks
from kernels.native import linear as native_linear
from kernels.page_table import PageTable

log = structlog.get_logger("gpu_worker.runner")


@dataclass
class SequenceState:
    token_ids: list[int]
    sampling: Sampling
    num_generated: int
    block_table: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    num_computed: int = -1  # tokens whose K/V is in the cache; -1: new, take the plan's count (prefix-cache hits)
    prompt_logprobs: int | None = None  # alternatives per prompt position to score (gpu_worker/prompt_logprobs.py)
    controls: RowControls | None = None  # logits controls' state, built at the first sampled step (logits_processors)
    constraint: RowConstraint | None = None  # the constraint's matcher, built at the first sampled step (constrained)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, hidden_size: int = 0, prepack: bool = True,
                  cpu_kernels: str = "auto") -> torch.dtype:
    """`auto`: bfloat16 on CUDA; on a CPU, bfloat16 where its matrix products are faster (cpu.worker_setup)."""
    if device.type == "cpu":
        return resolve_cpu_dtype(name, hidden_size, prepack, cpu_kernels)[0]
    return torch.bfloat16 if name == "auto" else getattr(torch, name)


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
        self.model_config, weights = load_checkpoint(self.model_path)
        mc: ModelConfig = self.model_config
        if self.device.type == "cpu":
            self.dtype, why = tp.rank0_choice(resolve_cpu_dtype(config.dtype, mc.hidden_size, config.weight_prepack,
                                                                   config.cpu_kernels))  # type: ignore[misc]
            log.info("cpu dtype and threads", dtype=str(self.dtype).removeprefix("torch."), requested=config.dtype,
                     reason=why, threads=threads, reserved_cpus=max(0, config.reserved_cpus),
                     weight_prepack=config.weight_prepack)
        else:
            self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.max_positions = min(config.max_model_len, mc.max_position_embeddings)
        prepack = config.weight_prepack and prepack_supported(self.device, self.dtype)
        self.c_linear = prepack and self.dtype == torch.bfloat16 and config.cpu_kernels != "torch"
        if self.c_linear and (why_not := native_linear.unavailable_reason(cpu_flags())):
            self.c_linear = False
            log.info("linear layers through oneDNN, not the C kernel", reason=why_not)
        c_linear_amx, c_linear_max_rows = (native_linear.plan(cpu_flags(), linear_shapes(mc, tp)) if self.c_linear
                                           else (False, None))
        if c_linear_max_rows is not None:
            log.info("linear layers through a C kernel up to a few rows, oneDNN above (weights packed for both)",
                     kernel="AMX tiles" if c_linear_amx else "AVX512-BF16 panels", max_rows=c_linear_max_rows,
                     reason="the CPU has AMX, where oneDNN wins on larger products")
        self.model = LlamaModel(mc, weights, self.device, self.dtype, self.max_positions, tp, prepack=prepack,
                                native_linear=self.c_linear, native_linear_max_rows=c_linear_max_rows,
                                native_linear_amx=c_linear_amx, fused=config.cpu_kernels != "torch")
        del weights
        elem = torch.empty(0, dtype=self.dtype).element_size()
        kv_heads = self.model.num_kv_heads  # this rank's share
        self.bytes_per_block = mc.num_hidden_layers * 2 * self.block_size * kv_heads * mc.head_dim * elem
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda":  # the KV cache is sized from free memory after a warm-up pass
            cuda = prepare_cuda_worker(self.model, config, self.device, self.dtype, self.block_size,
                                       self.bytes_per_block, self.max_positions)
            self.num_blocks, self.kv_cache, self.attention, self.graphs = (cuda.num_blocks, cuda.kv_cache,
                                                                           cuda.attention, cuda.graphs)
        else:
            budget_blocks = int(config.kv_cache_memory_gb * 2**30 // self.bytes_per_block)
            self.num_blocks = max(1, min(config.max_num_blocks, budget_blocks))
            # AMX CPUs: prompt chunks attend apart (an AMX tile kernel; without it, fresh prompts through SDPA).
            self.attention = create_attention_backend(config.attention_backend, self.model.num_heads,
                                                      kv_heads, mc.head_dim, self.device, self.dtype,
                                                      decode_kernel=config.cpu_kernels,
                                                      prompts_apart="amx_bf16" in cpu_flags())
            self.kv_cache = allocate_kv_cache(mc.num_hidden_layers, self.num_blocks, self.block_size,
                                              kv_heads, mc.head_dim, self.dtype, self.device, self.attention.kv_layout)
        # llguidance's tokenizer of the served vocabulary, built at the first constrained request.
        self.vocabulary = GuidanceVocabulary(self._tokenizer_json, mc.eos_token_ids, mc.vocab_size)
        self.sequences: dict[int, SequenceState] = {}
        self.swapped: dict[int, torch.Tensor] = {}  # seq id -> its blocks in host memory (preemption by swap)
        self._suspended_kv: torch.Tensor | None = None  # the KV cache in host memory while suspended (offload)
        self._suspend_mode = ""
        self._kv_shape: tuple[int, ...] = tuple(self.kv_cache.shape)
        self._recapture_graphs = False
        self.steps = 0
        log.info("model loaded", model=str(self.model_path), architecture=mc.architecture, device=str(self.device),
                 dtype=str(self.dtype).removeprefix("torch."), kv_blocks=self.num_blocks,
                 c_decode_attention=getattr(self.attention, "native_decode", False) and self.dtype == torch.bfloat16,
                 c_elementwise=self.model.fused, c_linear=self.c_linear,
                 kv_cache_mib=round(self.num_blocks * self.bytes_per_block / 2**20, 1),
                 load_seconds=round(time.perf_counter() - started, 2))

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
            pid=os.getpid(), tensor_parallel_size=self.tp.size,
        )

    def _apply_diffs(self, plan: worker_pb2.StepPlan) -> None:
        # The order is the contract's (worker.proto, StepPlan): reset, released, swap_out, swap_in, copies, new.
        if plan.reset:
            self.sequences.clear()
            self.swapped.clear()
            if self._suspend_mode:  # a new scheduler, which knows nothing of the suspend, owns this worker now
                self.resume_kv_cache()
        if self._suspend_mode:
            raise ExecutionError(f"step {plan.step_id}: the KV cache is suspended; call ResumeKVCache first")
        for seq_id in plan.released_seq_ids:
            self.sequences.pop(seq_id, None)
            self.swapped.pop(seq_id, None)
        for swap in plan.swap_out:
            state = self._state(plan, swap.seq_id)
            self.swapped[swap.seq_id] = swap_out_blocks(self.kv_cache, torch.tensor(list(swap.block_ids), device=self.device))
            state.block_table = np.zeros(0, dtype=np.int32)
        for swap in plan.swap_in:
            state, host = self._state(plan, swap.seq_id), self.swapped.pop(swap.seq_id, None)
            if host is None or host.shape[1] != len(swap.block_ids):
                raise ExecutionError(f"step {plan.step_id}: sequence {swap.seq_id} has no swapped blocks of that count")
            swap_in_blocks(self.kv_cache, host, torch.tensor(list(swap.block_ids), device=self.device))
            state.block_table = np.asarray(swap.block_ids, dtype=np.int32)
        if plan.block_copies:
            src = torch.tensor([c.src for c in plan.block_copies], device=self.device)
            dst = torch.tensor([c.dst for c in plan.block_copies], device=self.device)
            copy_blocks(self.kv_cache, src, dst)
        for new in plan.new_sequences:
            self.sequences[new.seq_id] = SequenceState(list(new.token_ids), resolve(new.params), new.num_generated,
                                                       prompt_logprobs=wanted(new.params, new.num_generated))

    def _state(self, plan: worker_pb2.StepPlan, seq_id: int) -> SequenceState:
        state = self.sequences.get(seq_id)
        if state is None:
            raise ExecutionError(f"step {plan.step_id}: sequence {seq_id} is unknown to this worker")
        return state

    # ------------------------------------------------------------------ suspend / resume

    def suspend_kv_cache(self, mode: str) -> int:
        """Release the KV cache's device memory: `persist` keeps it, `offload` moves it to host
        memory, `recompute` drops it (the scheduler re-queues its sequences). Returns bytes released."""
        if self._suspend_mode:
            return 0
        released = 0
        if mode in ("offload", "recompute"):
            released = self.kv_cache.numel() * self.kv_cache.element_size()
            self._kv_shape = tuple(self.kv_cache.shape)
            self._suspended_kv = self.kv_cache.to("cpu", copy=True) if mode == "offload" else None
            self.kv_cache = torch.empty(0, dtype=self.dtype, device=self.device)
            # CUDA graphs captured the cache's address: drop them now, capture again on resume.
            self._recapture_graphs, self.graphs = self.graphs is not None, None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._suspend_mode = mode
        log.info("kv cache suspended", mode=mode, released_bytes=released)
        return released

    def resume_kv_cache(self) -> None:
        mode, self._suspend_mode = self._suspend_mode, ""
        if mode == "offload" and self._suspended_kv is not None:
            self.kv_cache = self._suspended_kv.to(self.device)
        elif mode == "recompute":
            self.kv_cache = torch.zeros(self._kv_shape, dtype=self.dtype, device=self.device)
        if mode in ("offload", "recompute") and self._recapture_graphs:
            from gpu_worker.cuda_setup import capture_decode_graphs

            self.graphs = capture_decode_graphs(self.model, self.attention, self.kv_cache, self.config,
                                                self.kv_cache.shape[1] - 1, self.block_size, self.max_positions)
        self._suspended_kv = None
        log.info("kv cache resumed", mode=mode or "none")

    @torch.inference_mode()
    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        started = time.perf_counter()
        self._apply_diffs(plan)
        result = worker_pb2.StepResult(step_id=plan.step_id)
        if not plan.scheduled:
            return result
        states: list[SequenceState] = []
        tables, qo_lens, kv_lens, inputs = [], [], [], []
        spans: list[PromptSpan] = []  # prompt positions whose logprobs are asked for
        row_offset = 0  # this sequence's first row in the step's flattened tokens (the sum of qo_lens so far)
        for s in plan.scheduled:
            state = self.sequences.get(s.seq_id)
            if state is None:
                raise ExecutionError(f"step {plan.step_id}: sequence {s.seq_id} is unknown to this worker")
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
            if end > len(state.token_ids) or end > len(state.block_table) * self.block_size:
                raise ExecutionError(f"step {plan.step_id}: sequence {s.seq_id} cannot compute tokens up to {end} "
                                     f"({len(state.token_ids)} known, {len(state.block_table)} blocks)")
            if state.prompt_logprobs is not None:
                span = prompt_span(s.seq_id, state.prompt_logprobs, state.token_ids, state.num_generated,
                                   state.num_computed, s.num_tokens, row_offset)
                if span is None:  # the prompt is scored (chunks come in order): nothing more to look at
                    state.prompt_logprobs = None
                else:
                    spans.append(span)
            inputs.append(state.token_ids[state.num_computed:end])
            states.append(state)
            tables.append(state.block_table)
            qo_lens.append(s.num_tokens)
            row_offset += s.num_tokens
            kv_lens.append(end)
        table = PageTable.build(tables, np.asarray(qo_lens), np.asarray(kv_lens), self.block_size)
        positions, slots = table.token_positions()
        sample_idx = [i for i, s in enumerate(plan.scheduled) if s.sample]
        logits_rows = table.qo_indptr[1:].to(torch.int64)[sample_idx] - 1
        flat_inputs = np.fromiter((t for chunk in inputs for t in chunk), dtype=np.int64, count=table.num_tokens)
        if self.graphs is not None and not spans and self.graphs.can_run(table):  # decode-only step: replay a CUDA graph
            logits = self.graphs.run(table, flat_inputs, positions)[logits_rows.to(self.device)]
        else:
            self.attention.plan(table)
            hidden = self.model.hidden_states(
                torch.from_numpy(flat_inputs).to(self.device), torch.from_numpy(positions).to(self.device),
                torch.from_numpy(slots).to(self.device), self.kv_cache, self.attention)
            logits = self.model.logits(hidden[logits_rows.to(self.device)])
            if spans and self.tp.rank == 0:  # only rank 0's result goes back
                result.prompt_logprobs.extend(score(self.model, hidden, spans))
        for state, n in zip(states, qo_lens):
            state.num_computed += n
        if sample_idx:
            sampled = [states[i] for i in sample_idx]
            batch = build_sampling_batch(sampled, logits.shape[-1], self.model_config.eos_token_ids, self.device,
                                         self.vocabulary)
            tokens, logprobs = sample(logits, batch)
            tokens = self.tp.broadcast_tokens(tokens)  # every rank appends rank 0's choice
            token_list = tokens.tolist()
            for row, error in batch.record(token_list):  # a failed constraint: the scheduler fails that sample alone
                result.failures.add(seq_id=plan.scheduled[sample_idx[row]].seq_id, error=error)
            for st, tok in zip(sampled, token_list):
                st.token_ids.append(tok)
                st.num_generated += 1
            result.seq_ids.extend(plan.scheduled[i].seq_id for i in sample_idx)
            result.token_ids.extend(token_list)
            if logprobs is not None:
                result.logprobs.extend(logprobs.tolist())
            num_top = max(st.sampling.logprobs or 0 for st in sampled)
            if num_top:
                top_ids, top_values = top_logprobs(logits, num_top)
                result.num_top_logprobs = top_ids.shape[1]
                result.top_token_ids.extend(top_ids.flatten().tolist())
                result.top_logprobs.extend(top_values.flatten().tolist())
        self.steps += 1
        result.forward_seconds = time.perf_counter() - started
        return result
