"""KVCache: the preallocated paged K/V pool of all layers, and how many blocks fit a byte budget.

Layout: one contiguous tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 of dim 1 is K, 1 is V). Per layer, the K and V planes are contiguous, so attention can view
them as flat slot arrays [num_blocks * block_size, num_kv_heads, head_dim]; slot = block * block_size
+ offset. kv_transfer moves `kv[:, :, block_ids]` (all layers of a run of blocks) in one piece.

Tensor parallelism: each rank's pool holds the KV heads head_range = [start, stop) of the model's (its
TPLayout.kv_heads, engine/parallel/layout.py), num_kv_heads = stop - start of them; a block id names the same
tokens on every rank (rank 0's allocator hands out the ids), each rank holding its heads of them.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from engine.kv.block_allocator import BlockAllocator
from engine.kv.host_pages import commit_pages, zeroed_host_bytes

logger = logging.getLogger("tandem.engine")

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # the pool on CPU without kv_cache_memory


@dataclass(frozen=True)
class KVCacheSpec:
    """What one block costs and how blocks are shaped; equal specs can exchange blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVCache:
    """The K/V pool tensor plus the allocator that hands out its blocks."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device,
                 enable_prefix_caching: bool = True, head_range: tuple[int, int] | None = None) -> None:
        """head_range: the model's KV heads this pool holds (tensor parallelism); default all of them."""
        self.spec = spec
        self.num_blocks = num_blocks
        self.head_range = head_range or (0, spec.num_kv_heads)
        if self.head_range[1] - self.head_range[0] != spec.num_kv_heads:
            raise ValueError(f"head_range {self.head_range} does not hold the spec's {spec.num_kv_heads} KV heads")
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv = zeroed_pool((spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
                              spec.dtype, device)
        self.allocator = BlockAllocator(num_blocks, spec.block_size, enable_prefix_caching)

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as flat slot arrays, each [num_blocks * block_size, kv_heads, head_dim]."""
        spec = self.spec
        planes = self.kv[layer].view(2, self.num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
        return planes[0], planes[1]

    def commit_host_pages(self) -> float:
        """CPU: commit every page of the pool now (engine/kv/host_pages.py), so no K/V store ever waits on a page
        fault; its contents stay zero. Call it before the pool's first use. Returns the seconds it took (0.0 on a
        GPU, whose pool is resident from the start)."""
        if self.kv.device.type != "cpu":
            return 0.0
        start = time.perf_counter()
        commit_pages(self.kv.view(-1).view(torch.uint8).numpy())
        seconds = time.perf_counter() - start
        logger.info("KV cache: %.2f GiB committed at start in %.2f s", self.kv.nbytes / (1 << 30), seconds)
        return seconds

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Copy the K/V of block sources[i] into block targets[i], every layer (queued on the pool's device)."""
        device = self.kv.device
        source = torch.tensor(sources, dtype=torch.long, device=device)  # [B]
        target = torch.tensor(targets, dtype=torch.long, device=device)  # [B]
        self.kv.index_copy_(2, target, self.kv.index_select(2, source))  # [L, 2, B, block, H, D] moved


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On CPU its pages come from the OS already zeroed and are committed when first written
    (engine/kv/host_pages.py), so a pool sized from the host's memory costs nothing at start: torch.zeros wrote
    every byte (0.33 s a GiB here, the whole pool resident at once). KVCache.commit_host_pages commits them."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    return torch.from_numpy(zeroed_host_bytes(num_bytes)).view(dtype).view(shape)


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    """How many whole blocks fit budget_bytes; ValueError if not even one. Which budget the pool
    gets (explicit, CPU default, or measured on the GPU) is decided in engine/runner/memory_plan.py."""
    num_blocks = budget_bytes // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes holds no block of "
                         f"{spec.bytes_per_block} bytes; raise kv_cache_memory")
    return int(num_blocks)
