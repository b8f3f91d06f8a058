"""The data plane's view of an engine's paged KV pool: one tensor plus allocate/free callbacks."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import numpy as np
import torch

from kv_transfer.manifest import ManifestLimits, ModelFingerprint

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}

HostPieces = tuple[np.ndarray, list[memoryview]]
"""A run's bytes in host memory, two views of the same memory: [pieces, bytes] uint8 (row i piece i, flat and
contiguous: summed in one call), and each piece as a flat byte memoryview (a socket's scatter-gather list; slicing one
costs a fraction of a numpy view)."""


@dataclass(frozen=True)
class KVPoolView:
    """An engine's KV pool as the transfer plane sees it.

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 = K, 1 = V), on cpu or cuda.
    allocate(n) returns n free block ids (any order, not necessarily contiguous) or None when there is no room.
    free(ids) returns blocks to the pool. allocate_for(request_id, n), when given, is what receivers call
    instead of allocate: the blocks set aside for that request's KV (a decode worker reserves them when
    it accepts the request). The callbacks are called from transfer threads, so they must be
    thread-safe; each block handed to the plane is freed through `free` exactly once.
    kv_heads: the model's KV heads [start, stop) the pool holds when it holds only some (one rank of a
    tensor-parallel group, as a KV lane: kv_transfer/lanes/); its manifests say so, and it accepts only transfers
    of exactly those heads. None: every head (the manifests say nothing).
    windows: when given, the pool also takes a transfer of some of its heads (a lane's part, kv_transfer/lanes/
    parts.py): windows(heads) is the view that transfer lands in (its kv the pool's blocks narrowed to those heads,
    head_window), or None to refuse it.
    kv may be such a narrowed view (not contiguous): its runs then travel gathered and land from staging.
    allocation_waits: allocate_for may block a while (a lane follower waiting for rank 0's Expect): a transport
    whose thread serves other transfers too (gRPC's event loop) takes the blocks on another thread.
    """

    kv: torch.Tensor
    allocate: Callable[[int], list[int] | None]
    free: Callable[[Sequence[int]], None]
    allocate_for: Callable[[str, int], list[int] | None] | None = None
    kv_heads: tuple[int, int] | None = None
    windows: Callable[[tuple[int, int]], "KVPoolView | None"] | None = None
    allocation_waits: bool = False

    def allocate_incoming(self, request_id: str, num_blocks: int) -> list[int] | None:
        """Blocks for `request_id`'s incoming KV: allocate_for when given, else allocate."""
        if self.allocate_for is not None:
            return self.allocate_for(request_id, num_blocks)
        return self.allocate(num_blocks)

    def __post_init__(self) -> None:
        if self.kv.dim() != 6 or self.kv.shape[1] != 2:
            raise ValueError(f"kv must be [L, 2, num_blocks, block_size, H, D], got {tuple(self.kv.shape)}")
        if self.kv.dtype not in DTYPE_NAMES:
            raise ValueError(f"kv dtype {self.kv.dtype} not supported; use one of {list(DTYPE_NAMES)}")
        if self.kv.stride(-1) != 1 or (not self.kv.is_contiguous() and self.kv_heads is None):
            raise ValueError("kv must be contiguous (or a head window of a contiguous pool: head_window)")
        if self.kv_heads is not None and self.kv_heads[1] - self.kv_heads[0] != self.kv.shape[4]:
            raise ValueError(f"kv_heads {self.kv_heads} do not span the pool's {self.kv.shape[4]} KV heads")

    @cached_property
    def device(self) -> torch.device:
        """kv's device (read once: a torch attribute costs a transfer microseconds each time, cold)."""
        return self.kv.device

    @cached_property
    def on_host(self) -> bool:
        """Whether kv lives in host memory (read once, like device)."""
        return self.kv.device.type == "cpu"

    @cached_property
    def contiguous(self) -> bool:
        """Whether kv is the pool's own memory in order (a run's planes are then contiguous: they may travel and land
        in place); False for a head window (head_window)."""
        return self.kv.is_contiguous()

    @cached_property
    def heads(self) -> tuple[int, int]:
        """The model's KV heads [start, stop) the pool holds (kv_heads, else all of its own)."""
        return self.kv_heads or (0, self.kv.shape[4])

    def head_window(self, heads: tuple[int, int]) -> torch.Tensor:
        """kv narrowed to the model's KV heads `heads` (within self.heads; ValueError otherwise): a view of the same
        blocks, [L, 2, num_blocks, block_size, heads, D], not contiguous unless it is every head."""
        start, stop = self.heads
        if not start <= heads[0] < heads[1] <= stop:
            raise ValueError(f"KV heads {heads} are not within the pool's {self.heads}")
        return self.kv.narrow(4, heads[0] - start, heads[1] - heads[0])

    def landing_view(self, heads: tuple[int, int] | None) -> "KVPoolView | None":
        """Where a transfer of the model's KV heads `heads` (a manifest's kv_heads) lands: this pool when they are its
        own, its window of them (windows) when it takes some of its heads, else None."""
        if heads == self.kv_heads:
            return self
        start, stop = self.heads
        if self.windows is None or heads is None or not start <= heads[0] < heads[1] <= stop:
            return None
        return self.windows(heads)

    @cached_property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    @cached_property
    def fingerprint(self) -> ModelFingerprint:
        return fingerprint_of(self.kv)

    @cached_property
    def _host_plane_bytes(self) -> np.ndarray:
        """A host pool's memory as [2 * num_layers, num_blocks * plane row bytes] uint8 (a view, no copy)."""
        if self.kv.device.type != "cpu" or not self.contiguous:
            raise ValueError("only a contiguous host pool has host planes")
        return self.kv.view(torch.uint8).numpy().reshape(2 * self.kv.shape[0], -1)

    @cached_property
    def _host_plane_buffers(self) -> list[memoryview]:
        """Each of _host_plane_bytes' planes as a flat byte memoryview (made once)."""
        return [memoryview(plane) for plane in self._host_plane_bytes]

    def host_planes(self, start: int, num_blocks: int) -> HostPieces:
        """The 2 * num_layers planes of blocks start..start+num_blocks-1 of a host pool, in staging order
        (layer-major, K then V), as views of the pool's memory (HostPieces: one uint8 numpy view [2L, plane
        bytes], and a flat memoryview per plane): block_planes without a torch op per plane. ValueError for a CUDA
        pool."""
        planes = self._host_plane_bytes  # [2L, N * row bytes]
        row = planes.shape[1] // self.num_blocks
        begin, end = start * row, (start + num_blocks) * row
        return planes[:, begin:end], [plane[begin:end] for plane in self._host_plane_buffers]

    @cached_property
    def manifest_limits(self) -> ManifestLimits:
        """What a manifest for this pool may ask for: its layout (or a window of its heads, with windows), and at
        most every block it has."""
        return ManifestLimits(self.fingerprint, self.num_blocks, self.heads if self.windows is not None else None)


def fingerprint_of(kv: torch.Tensor) -> ModelFingerprint:
    """The layout fingerprint of a KV pool tensor."""
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv.shape
    return ModelFingerprint(num_layers, num_kv_heads, head_dim, DTYPE_NAMES[kv.dtype], block_size)
