"""Paged attention: the per-step metadata, the backends (triton / cpu_kernel / torch) and their kernels.

A layer calls `paged_attention(q, k, v, k_pool, v_pool, meta)`; the backend chosen at engine start
(`select_backend`, from EngineConfig.attention_backend) travels in the step's metadata.
"""
from engine.attention.backends import AttentionBackend, select_backend
from engine.attention.metadata import AttentionMetadata, StepTensors, build_step_tensors


def paged_attention(q, k, v, k_pool, v_pool, meta: AttentionMetadata):
    """Store this step's K/V into the pool, then attend (see AttentionBackend.forward)."""
    return meta.backend.forward(q, k, v, k_pool, v_pool, meta)


__all__ = ["AttentionBackend", "AttentionMetadata", "StepTensors", "build_step_tensors", "paged_attention",
           "select_backend"]
