"""Giving an engine's device memory back once the engine lets go of its tensors (LLMEngine.close)."""
from __future__ import annotations

import gc

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
