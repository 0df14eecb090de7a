"""FlashInfer-style page-table metadata for one engine step, shared by every attention backend.

For a batch of B sequences flattened into T query tokens:
- `qo_indptr[i]:qo_indptr[i+1]` are sequence i's query rows (the tokens computed this step);
- `kv_indices[kv_indptr[i]:kv_indptr[i+1]]` are its KV pages (block ids), in order;
- `kv_last_page_len[i]` is how many slots of its last page hold a token (1..block_size).
A sequence's KV length is therefore (num_pages - 1) * block_size + last_page_len, and it
includes the tokens computed this step, which are its last q_len positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PageTable:
    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int32 [num_pages]
    kv_last_page_len: torch.Tensor  # int32 [B]
    block_size: int
    # Host (numpy) copies: planning reads these without touching device tensors.
    qo_lens: np.ndarray  # int64 [B]
    kv_lens: np.ndarray  # int64 [B]

    @property
    def batch_size(self) -> int:
        return int(self.qo_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.qo_lens.sum())

    @staticmethod
    def build(block_tables: list[np.ndarray], qo_lens: np.ndarray, kv_lens: np.ndarray, block_size: int) -> "PageTable":
        """From per-sequence block tables (only the pages that hold tokens are used)."""
        qo_lens = np.asarray(qo_lens, dtype=np.int64)
        kv_lens = np.asarray(kv_lens, dtype=np.int64)
        num_pages = (kv_lens + block_size - 1) // block_size
        pages = [table[:n] for table, n in zip(block_tables, num_pages)]
        kv_indices = np.concatenate(pages) if pages else np.zeros(0, dtype=np.int32)
        return PageTable(
            qo_indptr=torch.from_numpy(np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)),
            kv_indptr=torch.from_numpy(np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32)),
            kv_indices=torch.from_numpy(kv_indices.astype(np.int32)),
            kv_last_page_len=torch.from_numpy((kv_lens - (num_pages - 1) * block_size).astype(np.int32)),
            block_size=block_size,
            qo_lens=qo_lens,
            kv_lens=kv_lens,
        )

    def token_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions, cache slots) of every query token, flattened in batch order.

        A slot is page * block_size + offset: where the token's K/V is written.
        """
        qo_indptr = self.qo_indptr.numpy().astype(np.int64)
        seq_of_token = np.repeat(np.arange(self.batch_size), self.qo_lens)
        first_new = self.kv_lens - self.qo_lens  # position of each sequence's first query token
        positions = first_new[seq_of_token] + (np.arange(self.num_tokens) - qo_indptr[seq_of_token])
        kv_indptr = self.kv_indptr.numpy().astype(np.int64)
        pages = self.kv_indices.numpy().astype(np.int64)[kv_indptr[seq_of_token] + positions // self.block_size]
        return positions, pages * self.block_size + positions % self.block_size
