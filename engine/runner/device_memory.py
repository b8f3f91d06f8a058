"""Giving an engine's device memory back once the engine lets go of its tensors (LLMEngine.close)."""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch


def release_device_memory(device: torch.device) -> None:
    """Collect what Python still holds unreachable (reference cycles, a failed step's traceback frames), then
    on CUDA wait for the device, free cuBLAS's per-stream workspaces and hand the caching allocator's unused
    blocks back to the device, so the next engine in this process, and other processes, can use the memory.
    Tensors still referenced somewhere stay allocated: this frees only what nothing holds."""
    gc.collect()
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    clear_cublas_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_cublas_workspaces is not None:
        clear_cublas_workspaces()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """Collect once, then keep Python's cyclic garbage collector off until the block ends (CUDA graph capture).

    A collection that starts while a stream is capturing runs finalizers in the middle of the capture: one that
    frees device memory, closes a CUDA IPC mapping or synchronizes (an earlier engine's or transfer's tensors
    left in a reference cycle) is illegal there and aborts the process. Nothing is lost: the garbage made in the
    block is collected by the next collection after it. The collector's earlier state is restored on the way out.
    """
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
