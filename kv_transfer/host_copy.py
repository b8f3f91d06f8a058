"""Host copies and sums of the transfer plane, on threads of the plane's own (never an OpenMP team).

A transfer thread runs beside an engine whose steps already keep the cores busy with torch's intra-op threads. A
torch op on a large CPU tensor, called from a transfer thread, starts an OpenMP team of its own: on a busy host each
such region waits for cores, and its threads spin after it, taking CPU from the step (measured on 2 cores with the
other one busy: a 1 MiB checksum 0.13 ms on one thread, 7.9 ms on two). So the plane's host copies and checksum
sums go through numpy, which runs them on the calling thread at memory speed; an operation of SPLIT_BYTES or more
is cut in two halves, the second on a short-lived thread of its own (numpy releases the GIL), which a busy host
schedules like any thread instead of spinning for it. CUDA tensors keep torch (on the transfer's copy stream).
Every function here moves bytes exactly: tensors are viewed as integers of their element size (numpy has no
bfloat16), so the dtype never matters.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import numpy as np
import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SPLIT_BYTES = 4 << 20  # an operation this large runs as two halves on two threads


def _in_halves(work: Callable[[int, int], None], length: int, nbytes: int) -> None:
    """work(start, end) over [0, length): at once below SPLIT_BYTES, else its halves on this thread and another."""
    if nbytes < SPLIT_BYTES or length < 2:
        work(0, length)
        return
    middle, failed = length // 2, []

    def second() -> None:
        try:
            work(middle, length)
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread below
            failed.append(exc)

    helper = threading.Thread(target=second, name="kv-host-copy", daemon=True)
    helper.start()
    work(0, middle)
    helper.join()
    if failed:
        raise failed[0]


def _split_axis(shape: Sequence[int]) -> int:
    """The first axis with two entries or more (0 when there is none): halves along it keep C order."""
    return next((axis for axis, size in enumerate(shape) if size >= 2), 0)


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (any strides), as integers of its element size."""
    return tensor.view(_INT_OF_SIZE[tensor.element_size()]).numpy()


def on_host(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src (same shape and dtype): on this thread for host tensors, else torch's non-blocking copy."""
    if on_host(dst, src) and dst.dtype == src.dtype and dst.shape == src.shape:
        out, values = host_array(dst), host_array(src)
        axis = _split_axis(out.shape)
        cut = (slice(None),) * axis

        def copy(start: int, end: int) -> None:
            np.copyto(out[cut + (slice(start, end),)], values[cut + (slice(start, end),)], casting="no")

        if out.ndim:
            _in_halves(copy, out.shape[axis], out.nbytes)
        else:
            np.copyto(out, values)
    else:
        dst.copy_(src, non_blocking=True)


def take_blocks(dst: torch.Tensor, src: torch.Tensor, block_ids: Sequence[int], dim: int) -> None:
    """dst[...] = src.index_select(dim, block_ids) (dst contiguous, same dtype), without a temporary on the host."""
    if on_host(dst, src) and dst.dtype == src.dtype and dst.is_contiguous():
        np.take(host_array(src), np.asarray(block_ids, dtype=np.int64), axis=dim, out=host_array(dst))
        return
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=src.device)
    if dst.device == src.device:
        torch.index_select(src, dim, ids, out=dst)
    else:  # a CUDA pool, host staging: gather on the device, then one copy
        dst.copy_(src.index_select(dim, ids), non_blocking=True)


def put_blocks(dst: torch.Tensor, src: torch.Tensor, block_ids: Sequence[int], dim: int) -> None:
    """dst.index_copy_(dim, block_ids, src) (same dtype): on this thread for host tensors."""
    if on_host(dst, src) and dst.dtype == src.dtype:
        index = (slice(None),) * dim + (np.asarray(block_ids, dtype=np.int64),)
        host_array(dst)[index] = host_array(src)
        return
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=dst.device)
    dst.index_copy_(dim, ids, src.to(dst.device, non_blocking=True))


def row_sums(words: torch.Tensor) -> torch.Tensor | np.ndarray:
    """words [..., W] (integers, any strides) summed over the last dim mod 2**64, flattened: int64, as numpy on
    the host (this thread), as a tensor on its device otherwise."""
    if not on_host(words):
        return words.sum(-1, dtype=torch.int64).flatten()
    values = host_array(words)
    axis = _split_axis(values.shape[:-1])
    sums = np.empty(values.shape[:-1], dtype=np.int64)
    cut = (slice(None),) * axis

    def reduce(start: int, end: int) -> None:
        np.add.reduce(values[cut + (slice(start, end),)], axis=-1, dtype=np.int64, out=sums[cut + (slice(start, end),)])

    _in_halves(reduce, values.shape[axis], values.nbytes)
    return sums.reshape(-1)
