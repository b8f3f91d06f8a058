"""Where the suite runs engines and kernels: on the GPU when the machine has one, else on the CPU (the Triton
kernels under Triton's interpreter, which tests/conftest.py turns on). On a GPU every test engine gets a small
KV pool unless the test sizes one: the default (85% of the card) would leave nothing for the next engine."""
from __future__ import annotations

import torch

from engine import LLM

TEST_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU_TEST_KV_BYTES = 128 << 20   # 2,048 blocks of the embedded default model, 8,192 of a tiny checkpoint
POOL_OPTIONS = frozenset({"kv_cache_memory", "num_kv_blocks", "gpu_memory_utilization"})


def make_llm(model: str | None = None, **options) -> LLM:
    """LLM(model, **options), with a KV pool of GPU_TEST_KV_BYTES when it would go on a GPU and the options size
    none. On a CPU-only machine exactly LLM(model, **options). Close it (or use it in a `with`) when the test
    is done with it."""
    on_gpu = torch.cuda.is_available() and options.get("device", "auto") in ("auto", "cuda")
    if on_gpu and not POOL_OPTIONS & options.keys():
        options["kv_cache_memory"] = GPU_TEST_KV_BYTES
    return LLM(model, **options)


def kernel_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the device the kernels are tested on (TEST_DEVICE)."""
    return tensor.to(TEST_DEVICE)
