"""Small host lists onto the device without a host sync (shared by the sampler and its processors), and a device
tensor's copy back to a host list (HostCopy)."""
from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on device; non_blocking, as a blocking CUDA copy would wait on the stream (a sync)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def row_values(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor | float | int:
    """One value per row, to broadcast against [R, n]: the shared value itself when every row has the same (nothing
    copied: the common case of a batch of requests with the same sampling parameters), else [R, 1] on the device
    (one non-blocking copy)."""
    first = values[0]
    if all(value == first for value in values):
        return first
    return to_device(values, dtype, device).unsqueeze(1)


class HostCopy:
    """A device-to-host copy under way (StepIO.start_to_host)."""

    def __init__(self, landing: torch.Tensor, numel: int, copied: torch.cuda.Event | None) -> None:
        self._landing, self._numel, self._copied = landing, numel, copied

    def wait(self) -> list:
        """The copied values as a list, once the copy is done (blocks until then)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._landing[:self._numel].tolist()
