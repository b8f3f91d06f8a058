"""Host values the device needs for a step's sampling, collected before the step's one upload (Uploads), small host
lists onto the device one by one for calls made outside a step (to_device), and a device tensor's copy back to a
host list (HostCopy)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on device; non_blocking, as a blocking CUDA copy would wait on the stream (a sync)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


@dataclass(frozen=True)
class Key:
    """Where one array of an Uploads is (its index)."""

    index: int


class Uploads:
    """The host arrays a step's sampling reads on the device (row indexes, per-row parameters, bitmasks, penalty
    histories), gathered while the step is planned on the host, before its forward. `add` only records the values
    and returns their Key; whoever stages the step lays the arrays out behind its own fields, writes each through a
    numpy view of its staging buffer and `bind`s the device views (engine/step_io.py `stage_uploads`): they
    cross in the step's one host-to-device copy. Device code reads `get(key)` once bound."""

    def __init__(self) -> None:
        self.arrays: list[tuple[np.dtype, object, int]] = []  # (dtype, values, count) per key
        self._device: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.arrays)

    def add(self, values, dtype) -> Key:
        """values (a list, a numpy array or a host tensor, flattened) as a 1-D array of the numpy dtype."""
        count = values.numel() if isinstance(values, torch.Tensor) else len(values)
        self.arrays.append((np.dtype(dtype), values, count))
        return Key(len(self.arrays) - 1)

    def add_filled(self, count: int, dtype, fill: Callable[[np.ndarray], None]) -> Key:
        """count values of the numpy dtype that fill(view) writes straight into their place when the step is staged
        (view: 1-D, host): nothing is built first and copied in after (a step's grammar bitmasks)."""
        self.arrays.append((np.dtype(dtype), fill, count))
        return Key(len(self.arrays) - 1)

    def shared_or_add(self, values: list, dtype) -> float | int | Key:
        """The value every row shares (nothing to upload: a batch whose rows share their parameters), else
        the values' Key ([R])."""
        first = values[0]
        if all(value == first for value in values):
            return first
        return self.add(values, dtype)

    def write(self, views: list[np.ndarray]) -> None:
        """Each array into its host view (views[i] has arrays[i]'s dtype and count)."""
        for view, (_, values, _) in zip(views, self.arrays):
            if callable(values):  # add_filled
                values(view)
            else:
                view[:] = values.reshape(-1).numpy() if isinstance(values, torch.Tensor) else values

    def bind(self, tensors: list[torch.Tensor]) -> None:
        """The arrays' device tensors (1-D, in key order): what `get` returns from now on."""
        self._device = tensors

    def bind_each(self, device: torch.device) -> None:
        """Copies every array to device on its own (calls made outside a step: tests, benchmarks)."""
        self._device = [_host_tensor(values, dtype, count).to(device, non_blocking=True)
                        for dtype, values, count in self.arrays]

    def get(self, key: Key) -> torch.Tensor:
        """The array of key on the device, 1-D."""
        return self._device[key.index]

    def per_row(self, value: float | int | Key) -> float | int | torch.Tensor:
        """A shared_or_add value to broadcast against [R, n]: the scalar itself, or [R, 1] on the device."""
        return self.get(value).unsqueeze(1) if isinstance(value, Key) else value


def _host_tensor(values, dtype: np.dtype, count: int) -> torch.Tensor:
    if callable(values):  # add_filled
        array = np.empty(count, dtype=dtype)
        values(array)
        return torch.from_numpy(array)
    if isinstance(values, torch.Tensor):
        return values.reshape(-1)
    return torch.from_numpy(np.asarray(values, dtype=dtype))


class HostCopy:
    """A device-to-host copy under way (StepIO.start_to_host)."""

    def __init__(self, landing: torch.Tensor, numel: int, copied: torch.cuda.Event | None) -> None:
        self._landing, self._numel, self._copied = landing, numel, copied

    def wait(self) -> list:
        """The copied values as a list, once the copy is done (blocks until then)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._landing[:self._numel].tolist()
