"""FlashInfer paged attention on CUDA, behind the same `plan(PageTable)` / `run(q, layer_cache)` interface.

Written against flashinfer-python 0.7.2.post1 (`BatchPrefillWithPagedKVCacheWrapper`,
`BatchDecodeWithPagedKVCacheWrapper`, `append_paged_kv_cache`); `flashinfer` is imported only
when a backend object is built, so CPU machines never need it.

- One shared 256 MiB float workspace for every wrapper of a worker (prefill, decode, and each
  CUDA-graph decode batch size): only one of them runs at a time.
- `plan()` once per step: steps whose sequences all compute one token use the decode wrapper,
  any step with a prompt chunk uses the prefill wrapper (causal; FlashInfer aligns the causal
  mask bottom-right, so a chunk after a cached prefix sees the prefix). `qo_indptr`, `kv_indptr`
  and `kv_last_page_len` go to `plan()` as int32 CPU tensors, so planning reads them without a
  device sync; `kv_indices` is copied to the device once per step and shared with the K/V write.
- K/V are written with `append_paged_kv_cache` from per-token (batch index, position) arrays
  computed on the host from the same page table (the slots argument of `write_kv` is unused).
- Cache layout per layer: [num_blocks, 2, block_size, kv_heads, head_dim], i.e. FlashInfer's NHD.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cache_ops import in_cache_dtype
from kernels.page_table import PageTable

# FlashInfer's scratch (split-KV partial results at large batches and long contexts): vLLM gives it 256 MiB,
# SGLang 384 MiB. The start-up's warm-up allocates it before the KV pool is sized, so it is accounted for.
WORKSPACE_BYTES = 256 * 2**20
# Head sizes FlashInfer's paged kernels are instantiated for (DISPATCH_HEAD_DIM in 0.7.2).
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
MIN_COMPUTE_CAPABILITY = (7, 5)


def decode_uses_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    """Use the tensor-core (prefill-kernel) decode path when the GQA group is larger than 4.

    FlashInfer's CUDA-core decode kernel is compiled for group sizes 1, 2, 3, 4, 6, 8, 16 only
    (a group of 7 has no kernel at all), and beyond 4 the tensor-core path is the faster one
    (the same threshold vLLM and SGLang use). So: group <= 4 -> CUDA cores, else tensor cores.
    """
    return num_qo_heads // num_kv_heads > 4


def append_indices(table: PageTable) -> tuple[np.ndarray, np.ndarray]:
    """(batch index, position in its sequence) of every query token, int32: `append_paged_kv_cache`'s input.

    The token's cache slot is then kv_indices[kv_indptr[b] + pos // block_size] * block_size
    + pos % block_size: the same slot `PageTable.token_positions` gives the torch write path.
    """
    batch = np.repeat(np.arange(table.batch_size, dtype=np.int32), table.qo_lens)
    positions, _ = table.token_positions()
    return batch, positions.astype(np.int32)


def flashinfer_unavailable_reason(device: torch.device, head_dim: int, dtype: torch.dtype | None) -> str | None:
    """Why the FlashInfer backend cannot serve this worker, or None when it can."""
    if device.type != "cuda":
        return f"device is {device.type}, FlashInfer needs CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_COMPUTE_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} is below 7.5"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of FlashInfer's {SUPPORTED_HEAD_DIMS}"
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')} is not bfloat16 or float16"
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a missing runtime dependency inside it
        return f"flashinfer is not importable ({type(exc).__name__}: {exc})"
    return None


def new_workspace(device: torch.device) -> torch.Tensor:
    # Zeroed: FlashInfer asks for a zero-initialized float workspace on first use.
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


class _Shape:
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str,
                 dtype: torch.dtype, kv_dtype: torch.dtype | None = None, scale: float | None = None,
                 window: int = 0) -> None:
        """kv_dtype: the cache's element, dtype (the default) or float8_e4m3fn (FlashInfer's fp8 KV kernels;
        new K/V rounded by torch's conversion as they are appended). `scale`: q·k's factor (FlashInfer's
        sm_scale; head_dim ** -0.5 unless given). `window` (sliding-window layers): a query at p sees the keys
        p - window + 1 .. p (FlashInfer's window_left = window - 1)."""
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"FlashInfer computes in bfloat16 or float16, not {dtype}; set dtype accordingly")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        if self.kv_dtype not in (dtype, torch.float8_e4m3fn):
            raise ValueError(f"FlashInfer's cache holds {dtype} or float8_e4m3fn, not {self.kv_dtype}")
        self.use_tensor_cores = decode_uses_tensor_cores(num_qo_heads, num_kv_heads)
        self.scale = scale or head_dim ** -0.5
        self.window = window

    def plan_kwargs(self) -> dict:
        return dict(pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=self.scale,
                    window_left=self.window - 1 if self.window else -1)

    def appended(self, x: torch.Tensor) -> torch.Tensor:
        """New K or V rows in the cache's element type (FlashInfer appends rows of the cache's dtype); fp8
        saturated at +-448 rather than NaN (cache_ops.in_cache_dtype)."""
        return in_cache_dtype(x, self.kv_dtype)


class FlashInferPagedAttention(_Shape):
    """Eager FlashInfer attention: any mix of prompt chunks and decodes."""

    name = "flashinfer"
    kv_layout = "NHD"

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16, workspace: torch.Tensor | None = None,
                 kv_dtype: torch.dtype | None = None, scale: float | None = None, window: int = 0) -> None:
        super().__init__(num_qo_heads, num_kv_heads, head_dim, device, dtype, kv_dtype, scale, window)
        import flashinfer

        self._flashinfer = flashinfer
        self.workspace = workspace if workspace is not None else new_workspace(self.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                    use_tensor_cores=self.use_tensor_cores)
        self._wrapper = self.decode
        self._append: tuple[torch.Tensor, ...] = ()
        self._table: PageTable | None = None
        self._windows: dict[int, FlashInferPagedAttention] = {}

    def windowed(self, window: int) -> FlashInferPagedAttention:
        """The backend of the sliding-window layers of `window` positions, planned with this one's table (its own
        wrappers and workspace: a plan lives in its workspace)."""
        sibling = self._windows.get(window)
        if sibling is None:
            sibling = self._windows[window] = FlashInferPagedAttention(
                self.num_qo_heads, self.num_kv_heads, self.head_dim, self.device, self.dtype,
                kv_dtype=self.kv_dtype, scale=self.scale, window=window)
        if self._table is not None:
            sibling.plan_once(self._table)
        return sibling

    def plan_once(self, table: PageTable) -> None:
        """`plan`, unless this table is the one planned already (each window layer asks in turn)."""
        if table is not self._table:
            self.plan(table)

    def plan(self, table: PageTable) -> None:
        self._table = table
        dev = self.device
        kv_indices = table.kv_indices.to(dev, non_blocking=True)
        batch, positions = append_indices(table)
        self._append = (torch.from_numpy(batch).to(dev, non_blocking=True),
                        torch.from_numpy(positions).to(dev, non_blocking=True),
                        kv_indices, table.kv_indptr.to(dev, non_blocking=True),
                        table.kv_last_page_len.to(dev, non_blocking=True))
        shape = (self.num_qo_heads, self.num_kv_heads, self.head_dim, table.block_size)
        if bool((table.qo_lens == 1).all()):
            self.decode.plan(table.kv_indptr, kv_indices, table.kv_last_page_len, *shape, **self.plan_kwargs())
            self._wrapper = self.decode
        else:
            self.prefill.plan(table.qo_indptr, table.kv_indptr, kv_indices, table.kv_last_page_len, *shape,
                              causal=True, **self.plan_kwargs())
            self._wrapper = self.prefill

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        batch, positions, kv_indices, kv_indptr, last_page_len = self._append
        self._flashinfer.append_paged_kv_cache(self.appended(key), self.appended(value), batch, positions, kv_cache,
                                               kv_indices, kv_indptr, last_page_len, kv_layout="NHD")

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        # The model hands q as a view of a joint q|k buffer (RoPE runs once over both): make it dense.
        return self._wrapper.run(q.contiguous(), kv_cache)


class FlashInferGraphDecode(_Shape):
    """Decode attention for one captured CUDA-graph batch size.

    Every device array the graph reads lives in a buffer allocated here once: `plan()` (outside
    the graph, before each replay) copies the step's padded page table into them, and the
    captured `append_paged_kv_cache` and decode kernels read them at replay.
    """

    name = "flashinfer"
    kv_layout = "NHD"

    def __init__(self, batch_size: int, kv_indices_buffer: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, device: torch.device | str, dtype: torch.dtype, workspace: torch.Tensor,
                 kv_dtype: torch.dtype | None = None, scale: float | None = None) -> None:
        super().__init__(num_qo_heads, num_kv_heads, head_dim, device, dtype, kv_dtype, scale)
        import flashinfer

        self._flashinfer = flashinfer
        self.batch_size = batch_size
        dev = self.device
        self.kv_indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
        self.kv_indices = kv_indices_buffer  # shared by every batch size: one graph replays at a time
        self.kv_last_page_len = torch.ones(batch_size, dtype=torch.int32, device=dev)
        self.batch_indices = torch.arange(batch_size, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(batch_size, dtype=torch.int32, device=dev)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=self.kv_indptr, paged_kv_indices_buffer=self.kv_indices,
            paged_kv_last_page_len_buffer=self.kv_last_page_len)

    def plan(self, table: PageTable) -> None:
        if table.batch_size != self.batch_size or not bool((table.qo_lens == 1).all()):
            raise ValueError(f"graph decode for batch {self.batch_size} got a table of {table.batch_size} "
                             f"sequences with up to {int(table.qo_lens.max())} query tokens")
        if len(table.kv_indices) > len(self.kv_indices):
            raise ValueError(f"{len(table.kv_indices)} pages exceed the graph buffer of {len(self.kv_indices)}")
        kv_indices = table.kv_indices.to(self.device, non_blocking=True)
        self.wrapper.plan(table.kv_indptr, kv_indices, table.kv_last_page_len, self.num_qo_heads,
                          self.num_kv_heads, self.head_dim, table.block_size, **self.plan_kwargs())
        self.positions.copy_(torch.from_numpy((table.kv_lens - 1).astype(np.int32)), non_blocking=True)

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        self._flashinfer.append_paged_kv_cache(self.appended(key), self.appended(value), self.batch_indices,
                                               self.positions, kv_cache, self.kv_indices, self.kv_indptr,
                                               self.kv_last_page_len,
                                               kv_layout="NHD")

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return self.wrapper.run(q.contiguous(), kv_cache)  # q: a view of the joint q|k buffer
