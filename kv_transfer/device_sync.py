"""Ordering of copies between a CUDA pool and staging buffers, on a side stream per transfer thread."""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from kv_transfer.pool import KVPoolView


def record_ready_event(pool: "KVPoolView") -> "torch.cuda.Event | None":
    """For a CUDA pool, an event on the caller's current stream marking that the pool's KV has been written; None
    for a host pool."""
    if pool.on_host:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(pool.device))
    return event


@contextmanager
def copy_stream(device: torch.device, after: "torch.cuda.Event | None" = None) -> Iterator[None]:
    """Runs the enclosed copies on a side stream that first waits for `after`, and blocks the
    calling thread until they are complete, so staging and pool are consistent on exit."""
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream(device)
    if after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()
