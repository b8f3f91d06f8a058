"""Small host lists onto the device without a host sync (shared by the sampler and its processors)."""
from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on device; non_blocking, as a blocking CUDA copy would wait on the stream (a sync)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
