"""The C decode-attention kernel (kernels/native/decode_attention.py) against dense float32 attention, its
batch invariance, and the fallback when it cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kernels.cache_ops import allocate_kv_cache, write_kv
from kernels.native import decode_attention as native_decode
from kernels.native import lib as native_lib
from kernels.page_table import PageTable
from kernels.torch_attention import TorchPagedAttention
from kernels.torch_attention import APART_MIN_ROWS
from tests.unit.kernels.test_kernels import dense_attention

REASON = native_lib.unavailable_reason()
# CI has a C compiler (its FlashInfer compile check needs one): there the kernel must build.
needs_kernel = pytest.mark.skipif(REASON is not None and os.environ.get("CI") != "true",
                                  reason=f"the C kernel cannot be built here: {REASON}")


def decode_case(lens: list[int], hq: int, hkv: int, d: int, block_size: int, seed: int = 0,
                fill: float | None = None):
    """A bf16 HND cache holding len K/V rows per sequence in shuffled pages, one query per sequence;
    `fill`: the value of every slot no sequence wrote."""
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 7
    cache = allocate_kv_cache(1, num_blocks, block_size, hkv, d, torch.bfloat16, "cpu", "HND")[0]
    if fill is not None:
        cache.fill_(fill)
    free = list(np.random.default_rng(seed).permutation(num_blocks))
    tables, keys, values = [], [], []
    for n in lens:
        table = np.array([free.pop() for _ in range(-(-n // block_size))], dtype=np.int32)
        k, v = torch.randn(n, hkv, d).to(torch.bfloat16), torch.randn(n, hkv, d).to(torch.bfloat16)
        pos = torch.arange(n)
        slots = torch.from_numpy(table[(pos // block_size).numpy()].astype(np.int64)) * block_size + pos % block_size
        write_kv(cache, k, v, slots, "HND")
        tables.append(table)
        keys.append(k)
        values.append(v)
    table = PageTable.build(tables, np.ones(len(lens), dtype=np.int64), np.array(lens), block_size)
    # Query rows strided like the model's (q heads of a fused q/k/v buffer).
    q = torch.randn(len(lens), hq + 2 * hkv, d).to(torch.bfloat16)[:, :hq]
    return cache, table, q, keys, values


def run_backend(kernel: str, cache, table, q, prompts_apart: bool = False) -> torch.Tensor:
    hq, d, hkv = q.shape[1], q.shape[2], cache.shape[2]
    backend = TorchPagedAttention(hq, hkv, d, decode_kernel=kernel, prompts_apart=prompts_apart)
    assert backend.native_decode == (kernel == "c")
    backend.plan(table)
    apart = (table.qo_lens > 1) & (table.qo_lens == table.kv_lens)  # no cached prefix
    if backend._amx_prompts:
        apart |= table.qo_lens >= APART_MIN_ROWS  # and long chunks over one, through the AMX kernel
    if prompts_apart and apart.any() and native_decode.takes_prompts(d, table.block_size):
        assert [n for _, n in backend.apart_prompts()] == list(table.qo_lens[apart])  # attended apart
        assert backend.native_rows() is not None  # and the C plan every other row
    return backend.run(q, cache)


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2), (9, 3), (8, 2), (10, 2)])  # G = 1-5: V sums in registers up to 4 at head size 64, 2 at 128
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_c_decode_matches_dense_float32(block_size: int, heads: tuple[int, int], head_dim: int) -> None:
    lens = [1, 9, 33, 16, 250]
    cache, table, q, keys, values = decode_case(lens, heads[0], heads[1], head_dim, block_size)
    out = run_backend("c", cache, table, q)
    torch_path = run_backend("torch", cache, table, q)
    for i, n in enumerate(lens):
        ref = dense_attention(q[i:i + 1].float(), keys[i].float(), values[i].float(), n - 1)
        # float32 inside, one bfloat16 rounding at the end: closer to the reference than the torch path.
        torch.testing.assert_close(out[i:i + 1].float(), ref, rtol=1e-2, atol=1e-2)
        assert (out[i:i + 1].float() - ref).abs().max() <= (torch_path[i:i + 1].float() - ref).abs().max() + 1e-2


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_vector_path_matches_the_plain_loops_and_ignores_slots_past_the_length(head_dim: int,
                                                                               block_size: int) -> None:
    """Where the CPU has AVX512-BF16 the kernel takes its vector path for these sizes (16 keys at a
    time, reading a page's slots past the sequence's length): it must agree with the plain loops,
    and the NaNs in the unwritten slots must not reach any output."""
    library = native_lib.load()
    lens = [1, 15, 16, 17, 40, 250]
    cache, table, q, keys, values = decode_case(lens, 9, 3, head_dim, block_size, seed=3, fill=float("nan"))
    backend = TorchPagedAttention(9, 3, head_dim, decode_kernel="c")
    backend.plan(table)
    out = backend.run(q, cache)
    assert not out.isnan().any()
    for i, n in enumerate(lens):
        ref = dense_attention(q[i:i + 1].float(), keys[i].float(), values[i].float(), n - 1)
        torch.testing.assert_close(out[i:i + 1].float(), ref, rtol=1e-2, atol=1e-2)
    if not library.decode_attention_bf16_vectorized(head_dim, block_size):
        pytest.skip("this CPU has no AVX512-BF16: only the plain loops exist here (checked above)")
    pages = torch.from_numpy(np.stack([np.pad(table.kv_indices[table.kv_indptr[i]:table.kv_indptr[i + 1]].numpy(),
                                              (0, 16)) [:16] for i in range(len(lens))])).to(torch.int32).contiguous()
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    rows = torch.arange(len(lens), dtype=torch.int64)
    plain = torch.empty_like(q.contiguous())
    assert library.decode_attention_bf16_generic(
        q.data_ptr(), q.stride(0), rows.data_ptr(), cache.data_ptr(), pages.data_ptr(), pages.shape[1],
        kv_lens.data_ptr(), plain.data_ptr(), plain.stride(0), len(lens), 9, 3, head_dim, block_size,
        head_dim ** -0.5) == 0
    # Same float32 math in another order, one bfloat16 rounding: at most a unit or two of the last place.
    torch.testing.assert_close(out.float(), plain.float(), rtol=2e-2, atol=2e-3)


@needs_kernel
def test_c_decode_rows_do_not_depend_on_the_batch() -> None:
    lens = [40, 3, 129, 17]
    cache, table, q, _, _ = decode_case(lens, 9, 3, 64, 16)
    together = run_backend("c", cache, table, q)
    for i, n in enumerate(lens):
        alone = PageTable.build([table.kv_indices[table.kv_indptr[i]:table.kv_indptr[i + 1]].numpy()],
                                np.array([1]), np.array([n]), 16)
        assert torch.equal(run_backend("c", cache, alone, q[i:i + 1]), together[i:i + 1])


@needs_kernel
@pytest.mark.parametrize("prompts_apart", [False, True], ids=["C prompts", "prompts apart"])
@pytest.mark.parametrize("block_size, head_dim", [(4, 8), (16, 64)])
def test_c_kernel_runs_a_mixed_step_decodes_and_prompt_chunks(block_size: int, head_dim: int,
                                                              prompts_apart: bool) -> None:
    """Where the kernel's vector path runs (16, 64 on an AVX512-BF16 CPU), prompt rows go through it too,
    each a decode over its sequence's tokens up to its own position: causal, and offset by a cached prefix
    (sequence 2: 5 cached tokens, a 7-token chunk; sequence 3: 20 cached, a 40-token chunk). Elsewhere the
    prompt rows take the torch path and only the decode row the C kernel: the same answers. With
    `prompts_apart` (AMX CPUs) the prompt with no cached prefix (sequence 1) attends apart (the AMX tile
    kernel, else SDPA), and with the AMX kernel the 40-token chunk too; the other rows the C kernel: the same
    answers again."""
    torch.manual_seed(1)
    lens, new = [10, 6, 12, 60], [1, 6, 7, 40]
    cache = allocate_kv_cache(1, 32, block_size, 2, head_dim, torch.bfloat16, "cpu", "HND")[0]
    if native_decode.takes_prompts(head_dim, block_size):
        cache.fill_(float("nan"))  # unwritten slots must never be read
    free = list(np.random.default_rng(1).permutation(32))
    tables, keys, values = [], [], []
    for n in lens:
        table = np.array([free.pop() for _ in range(-(-n // block_size))], dtype=np.int32)
        k, v = torch.randn(n, 2, head_dim).to(torch.bfloat16), torch.randn(n, 2, head_dim).to(torch.bfloat16)
        pos = torch.arange(n)
        write_kv(cache, k, v, torch.from_numpy(table[(pos // block_size).numpy()].astype(np.int64)) * block_size
                 + pos % block_size, "HND")
        tables.append(table)
        keys.append(k)
        values.append(v)
    table = PageTable.build(tables, np.array(new), np.array(lens), block_size)
    q = torch.randn(sum(new), 4, head_dim).to(torch.bfloat16)
    out = run_backend("c", cache, table, q, prompts_apart)
    start = 0
    for n, m, k, v in zip(lens, new, keys, values):
        ref = dense_attention(q[start:start + m].float(), k.float(), v.float(), n - m)
        torch.testing.assert_close(out[start:start + m].float(), ref, rtol=1e-2, atol=1e-2)
        start += m


def test_a_float32_cache_never_takes_the_c_kernel() -> None:
    assert not TorchPagedAttention(4, 2, 8, decode_kernel="auto", dtype=torch.float32).native_decode


def test_without_a_compiler_auto_falls_back_and_c_refuses(tmp_path) -> None:
    script = (
        "import torch\n"
        "from kernels.torch_attention import TorchPagedAttention\n"
        "assert TorchPagedAttention(4, 2, 8, decode_kernel='auto').native_decode is False\n"
        "try:\n"
        "    TorchPagedAttention(4, 2, 8, decode_kernel='c')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {**os.environ, "PATH": str(tmp_path), "HETERO_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.getcwd()}
    env.pop("CC", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "refused: cpu_kernels 'c' cannot be used: no C compiler" in done.stdout


@needs_kernel
def test_loading_and_running_the_kernels_leaves_ieee_floats_alone() -> None:
    """Built with -ffast-math the library's load would set flush-to-zero and denormals-are-zero for
    the whole process (crtfastmath.o): every float op of torch, numpy and Python around it changes."""
    assert native_lib.load() is not None
    run_backend("c", *decode_case([5, 20], 4, 2, 8, 4)[:3])
    subnormal = np.array([1e-40], dtype=np.float32)
    assert (subnormal * np.float32(2.0))[0] != 0.0
    assert float((torch.tensor([1e-40]) * 2)[0]) != 0.0
