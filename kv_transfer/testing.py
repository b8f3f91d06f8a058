"""Test and benchmark helpers: a KV pool made of a plain tensor and a tiny thread-safe free-list allocator."""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from kv_transfer.manifest import ModelFingerprint
from kv_transfer.pool import TORCH_DTYPES, KVPoolView


class FreeListPool:
    """A KV pool tensor plus a free list. Allocation pops ids from the front of the free list, so a pool
    whose free list was shuffled hands out non-contiguous ids. Double frees raise."""

    def __init__(self, fp: ModelFingerprint, num_blocks: int, device: str = "cpu", free_order: Sequence[int] | None = None):
        shape = (fp.num_layers, 2, num_blocks, fp.block_size, fp.num_kv_heads, fp.head_dim)
        self.kv = torch.zeros(shape, dtype=TORCH_DTYPES[fp.dtype], device=device)  # [L, 2, N, bs, H, D]
        self.num_blocks = num_blocks
        self._free = list(free_order) if free_order is not None else list(range(num_blocks))
        if sorted(self._free) != list(range(num_blocks)):
            raise ValueError("free_order must be a permutation of all block ids")
        self._lock = threading.Lock()

    def allocate(self, n: int) -> list[int] | None:
        with self._lock:
            if n > len(self._free):
                return None
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def free(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            overlap = set(block_ids) & set(self._free)
            if overlap or len(set(block_ids)) != len(block_ids):
                raise AssertionError(f"double free of blocks {sorted(overlap)}")
            self._free.extend(block_ids)

    def take(self, block_ids: Sequence[int]) -> None:
        """Marks specific ids as allocated (a test sets up a sender request this way)."""
        with self._lock:
            missing = set(block_ids) - set(self._free)
            if missing:
                raise AssertionError(f"blocks {sorted(missing)} are not free")
            taken = set(block_ids)
            self._free = [b for b in self._free if b not in taken]

    def next_free(self, n: int) -> list[int]:
        """The ids the next allocate(n) would hand out (changes nothing)."""
        with self._lock:
            return self._free[:n]

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def view(self) -> KVPoolView:
        return KVPoolView(self.kv, self.allocate, self.free)


def fill_blocks(kv: torch.Tensor, block_ids: Sequence[int], seed: int) -> None:
    """Writes reproducible random values into kv[:, :, block_ids]."""
    gen = torch.Generator().manual_seed(seed)
    for block in block_ids:
        values = torch.randn(kv[:, :, block].shape, generator=gen, dtype=torch.float32)
        kv[:, :, block].copy_(values.to(kv.dtype))


def blocks_bytes(kv: torch.Tensor, block_ids: Sequence[int]) -> bytes:
    """The raw bytes of kv[:, :, block_ids] in id order (for bit-exact comparisons across processes)."""
    picked = kv[:, :, list(block_ids)].contiguous().cpu()  # [L, 2, n, bs, H, D]
    return picked.view(torch.uint8).numpy().tobytes()
