"""Reusable staging buffers, so a transfer does not pay page faults on fresh memory every time."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import torch


class StagingPool:
    """Flat uint8 buffers on one device (pinned when staging host memory for a CUDA pool).

    acquire() hands out a buffer of at least nbytes that no one else uses until release(); released
    buffers are kept for reuse while the cache holds at most max_cached_bytes. Thread-safe.
    """

    def __init__(self, device: torch.device, pin_memory: bool = False, max_cached_bytes: int = 1 << 30):
        self.device = torch.device(device)
        self.pin_memory = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
        self.max_cached_bytes = max_cached_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._empty = torch.empty(0, dtype=torch.uint8, device=self.device)

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of exactly nbytes (a view of a possibly larger cached buffer; for 0 bytes, one empty
        tensor shared by every caller, which release() takes back as a no-op)."""
        if nbytes == 0:  # a transfer whose runs all go pool to pool: nothing to take from the cache
            return self._empty
        with self._lock:
            fitting = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]  # sorted by size
            if fitting:
                return self._free.pop(fitting[0])[:nbytes]
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device, pin_memory=self.pin_memory)[:nbytes]

    def release(self, view: torch.Tensor) -> None:
        """Returns a buffer obtained from acquire(); it may be reused at once."""
        if view is self._empty:
            return
        base = view._base if view._base is not None else view
        with self._lock:
            self._free.append(base)
            self._free.sort(key=torch.Tensor.numel)
            while self._free and sum(b.numel() for b in self._free) > self.max_cached_bytes:
                self._free.pop(0 if len(self._free) > 1 else -1)

    @contextmanager
    def borrowed(self, nbytes: int) -> Iterator[torch.Tensor]:
        view = self.acquire(nbytes)
        try:
            yield view
        finally:
            self.release(view)
