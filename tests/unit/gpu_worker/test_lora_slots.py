"""One step's LoRA products (gpu_worker/lora/lora_slots.py, issue 41): each row gets its own adapter's delta and the
base model's rows none; a row's delta is the same bits whatever else is in the step (alone, with other
adapters, in steps of other sizes), in float32 and bfloat16; with tensor parallelism the ranks' shares,
concatenated (q/k/v, gate/up) or summed (o, down), are the whole delta."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_worker.cpu.packed_linear import prepack_supported
from gpu_worker.lora.lora_slots import GROUPS, LoraSlots
from gpu_worker.model_config import ModelConfig
from gpu_worker.models.checkpoint import load_checkpoint
from gpu_worker.parallel.tensor_parallel import TensorParallel
from hetero_infer.bench.harness import make_tiny_llama, write_random_lora
from kernels.native import lora as native_lora

TARGET_SETS = [["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"],
               ["v_proj", "o_proj", "up_proj", "down_proj"]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, list[Path]]:
    root = tmp_path_factory.mktemp("lora-slots")
    config, _ = load_checkpoint(make_tiny_llama(root / "base", seed=1))
    adapters = [write_random_lora(config, root / f"a{i}", rank, TARGET_SETS[i], seed=i, scale=0.3)
                for i, rank in enumerate((8, 16, 4))]
    return config, adapters


def slots(config: ModelConfig, adapters: list[Path], dtype: torch.dtype, tp: TensorParallel = TensorParallel(),
          prepack: bool = True, native: bool | None = None) -> LoraSlots:
    prepack = prepack and prepack_supported(torch.device("cpu"), dtype)  # bfloat16 packs on AVX512 CPUs only
    loaded = LoraSlots(config, 4, 64, torch.device("cpu"), dtype, tp, prepack=prepack, native=native)
    for slot, path in enumerate(adapters, start=1):
        loaded.load(slot, f"a{slot}", str(path), trusted=True)
    return loaded


def deltas(loaded: LoraSlots, row_slots: list[int], x: torch.Tensor, group: str, out: int) -> torch.Tensor:
    y = torch.zeros(len(row_slots), out, dtype=x.dtype)
    batch = loaded.batch(np.array(row_slots))
    if batch is not None:
        batch.add(0, group, x, y)
    return y


PATHS = [pytest.param(True, marks=pytest.mark.skipif(not native_lora.available(torch.device("cpu"), torch.float32),
                                                     reason="no C compiler: the C kernel is not built")),
         False]


@pytest.mark.parametrize("native", PATHS, ids=["c-kernel", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_gets_its_adapters_delta_the_same_bits_in_any_step(model, dtype: torch.dtype, native: bool) -> None:
    config, adapters = model
    loaded = slots(config, adapters, dtype, native=native)
    g = torch.Generator().manual_seed(0)
    h, inter = config.hidden_size, config.intermediate_size
    for group, (width, out) in {"qkv": (h, loaded.config.num_attention_heads * config.head_dim
                                        + 2 * config.num_key_value_heads * config.head_dim),
                                "gate_up": (h, 2 * inter), "down": (inter, h)}.items():
        x = torch.randn(40, width, generator=g).to(dtype)
        mixed = [0, 1, 2, 3, 1, 0, 2] * 5 + [3, 3, 1, 2, 0]
        together = deltas(loaded, mixed, x, group, out)
        for row, slot in enumerate(mixed):
            alone = deltas(loaded, [slot], x[row:row + 1], group, out)
            assert torch.equal(together[row], alone[0]), (group, row, slot)
            if slot == 0 or not any(t in GROUPS[group] for t in TARGET_SETS[slot - 1]):
                assert not together[row].any()
        # The same rows among others, in steps of other sizes: the same bits again.
        for size in (3, 9, 17):
            assert torch.equal(deltas(loaded, mixed[:size], x[:size], group, out), together[:size])
        one = [2] * 12  # every row the same adapter: no gather
        assert torch.equal(deltas(loaded, one, x[:12], group, out)[5],
                           deltas(loaded, [0, 2], x[4:6], group, out)[1])


@pytest.mark.parametrize("native", PATHS, ids=["c-kernel", "linear"])
def test_an_adapter_adds_scaling_times_b_a_x(model, native: bool) -> None:
    """Against the adapter's own matrices: q_proj's block of the fused q/k/v product."""
    config, adapters = model
    loaded = slots(config, adapters[:1], torch.float32, prepack=False, native=native)
    from gpu_worker.lora.lora_adapter import load_lora_adapter

    adapter = load_lora_adapter("a", adapters[0], config, 64)
    a, b = adapter.weights[(0, "q_proj")]
    x = torch.randn(5, config.hidden_size)
    q = config.num_attention_heads * config.head_dim
    out = q + 2 * config.num_key_value_heads * config.head_dim
    got = deltas(loaded, [1, 0, 1, 1, 0], x, "qkv", out)
    want = adapter.scaling * (x @ a.T) @ b.T
    torch.testing.assert_close(got[[0, 2, 3], :q], want[[0, 2, 3]], rtol=1e-5, atol=1e-5)
    assert not got[[1, 4]].any()


@pytest.mark.parametrize("native", PATHS, ids=["c-kernel", "linear"])
def test_tensor_parallel_shares_make_the_whole_delta(model, native: bool) -> None:
    config, adapters = model
    whole = slots(config, adapters, torch.float32, prepack=False, native=native)
    shares = [slots(config, adapters, torch.float32, TensorParallel(rank, 2), prepack=False, native=native)
              for rank in (0, 1)]
    rows = [1, 2, 3, 0, 1]
    g = torch.Generator().manual_seed(1)
    h, inter = config.hidden_size, config.intermediate_size
    kv, q = config.num_key_value_heads * config.head_dim, config.num_attention_heads * config.head_dim
    # Column-parallel: each rank's output is its slice of every target's rows.
    x = torch.randn(5, h, generator=g)
    full = deltas(whole, rows, x, "gate_up", 2 * inter)
    parts = [deltas(s, rows, x, "gate_up", inter) for s in shares]
    halves = [torch.cat([p[:, :inter // 2] for p in parts], 1), torch.cat([p[:, inter // 2:] for p in parts], 1)]
    torch.testing.assert_close(torch.cat(halves, 1), full, rtol=1e-5, atol=1e-6)
    full = deltas(whole, rows, x, "qkv", q + 2 * kv)
    parts = [deltas(s, rows, x, "qkv", (q + 2 * kv) // 2) for s in shares]
    for start, size in ((0, q), (q, kv), (q + kv, kv)):
        shard = size // 2
        joined = torch.cat([p[:, start // 2:start // 2 + shard] for p in parts], 1)
        torch.testing.assert_close(joined, full[:, start:start + size], rtol=1e-5, atol=1e-6)
    # Row-parallel: each rank takes its slice of the input; the all-reduce sums the shares.
    x = torch.randn(5, inter, generator=g)
    full = deltas(whole, rows, x, "down", h)
    summed = sum(deltas(s, rows, x[:, r * inter // 2:(r + 1) * inter // 2], "down", h) for r, s in enumerate(shares))
    torch.testing.assert_close(summed, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", PATHS, ids=["c-kernel", "linear"])
def test_bfloat16_deltas_are_the_float32_ones_to_bfloat16_precision(model, native: bool) -> None:
    """Whichever kernel a bfloat16 model gets (on AVX512-BF16, bfloat16 weights and pairwise products)."""
    config, adapters = model
    exact, rounded = (slots(config, adapters, dtype, native=native) for dtype in (torch.float32, torch.bfloat16))
    g = torch.Generator().manual_seed(2)
    rows = [1, 2, 3, 0, 3, 1, 2, 2, 1]
    inter, h = config.intermediate_size, config.hidden_size
    for group, width, out in (("gate_up", h, 2 * inter), ("down", inter, h)):
        x = torch.randn(len(rows), width, generator=g).to(torch.bfloat16)
        want = deltas(exact, rows, x.float(), group, out)
        got = deltas(rounded, rows, x, group, out).float()
        scale = want.abs().max()
        assert (got - want).abs().max() <= 0.03 * scale, group
