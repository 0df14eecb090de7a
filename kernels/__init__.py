"""Paged attention and the KV cache's operations, for the worker's model.

- attention_backend: the `AttentionBackend` interface and the choice between its two kinds;
- torch_attention: the pure-torch backend (the CPU path and the oracle), flashinfer_backend the CUDA one
  (flashinfer_jit builds FlashInfer's modules ahead of use);
- page_table: FlashInfer's page-table metadata of a step, which every backend plans from;
- cache_ops: allocating the paged KV cache, writing K/V into it, copying and swapping blocks;
- native/: the CPU's C kernels and their ctypes wrappers.

Nothing is imported here: importing any submodule runs this file first, so a re-export here would
make each submodule that imports a sibling part of a cycle through it. Import from the submodules.
"""
