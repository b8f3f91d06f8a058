"""The host <-> device copies of a step, all made here and counted.

A step's inputs (token ids, per-sequence counts, block-table updates, sampled rows, and behind them what its
sampling reads: engine/host_lists.py Uploads, laid out by `uploads_layout` and written by `stage_uploads`) are
written through numpy views into one persistent host buffer (pinned on CUDA) and reach the device in one
host-to-device copy of the bytes used (`StagingBuffer.upload`); the device twin's views of the same layout are what
the forward and the sampler read. The sampled ids (with their logprobs and the step's prompt logprobs) come back
in one device-to-host copy (`StepIO.start_to_host`), on a side stream, waited for with an event. On CPU the twin is
the host buffer itself and the copies cost nothing, but they are counted the same way, so a CPU test sees what a GPU
step would pay (`CopyCounter`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.host_lists import HostCopy, Uploads

ALIGN = 8  # every field starts on an 8-byte boundary, so each dtype's view is aligned
LANDING_RING = 3  # device-to-host copies that may be outstanding before a landing buffer is reused
# Bytes a fixed buffer (the decode graphs') holds past its own fields for the step's sampling inputs (Uploads:
# per-row parameters, grammar bitmasks, penalty histories); a step needing more sends them in a copy of their own.
APPENDED_ROOM = 4 << 20

_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                 np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


class LandingRing:
    """LANDING_RING host buffers of one dtype taken in turn, so a buffer is reused only after LANDING_RING - 1
    later copies were started (an async engine has at most two outstanding)."""

    def __init__(self, dtype: torch.dtype, pin_memory: bool) -> None:
        self.dtype, self.pin_memory = dtype, pin_memory
        self.buffers = [torch.empty(0, dtype=dtype) for _ in range(LANDING_RING)]
        self.turn = -1

    def next(self, numel: int) -> torch.Tensor:
        """The next buffer in turn, replaced by a larger one (at least 1,024 elements) when it holds fewer than
        numel."""
        self.turn = (self.turn + 1) % LANDING_RING
        if self.buffers[self.turn].numel() < numel:
            self.buffers[self.turn] = torch.empty(max(numel, 1024), dtype=self.dtype, pin_memory=self.pin_memory)
        return self.buffers[self.turn]


@dataclass
class CopyCounter:
    """Copies made through StepIO since it was created (or last reset): what a test of a step counts."""

    host_to_device: int = 0
    device_to_host: int = 0

    def reset(self) -> None:
        self.host_to_device = self.device_to_host = 0


@dataclass(frozen=True)
class Field:
    """One named array in a staging layout: `count` elements of `dtype` at byte `offset`."""

    offset: int
    dtype: np.dtype
    count: int

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def layout(fields: Sequence[tuple[str, type, int]], start: int = 0) -> tuple[dict[str, Field], int]:
    """Offsets for (name, numpy dtype, count) fields packed in order from `start`, each 8-byte aligned; returns
    the fields by name and the end offset."""
    out, offset = {}, start
    for name, dtype, count in fields:
        out[name] = Field(offset, np.dtype(dtype), count)
        offset += -(-out[name].nbytes // ALIGN) * ALIGN
    return out, offset


def uploads_layout(uploads: Uploads, start: int) -> tuple[list[Field], int]:
    """The fields of uploads' arrays packed from byte `start`, in key order; and the end offset."""
    fields, end = layout([(str(i), dtype, count) for i, (dtype, _, count) in enumerate(uploads.arrays)], start)
    return list(fields.values()), end


def stage_uploads(staging: "StagingBuffer", fields: list[Field], uploads: Uploads) -> None:
    """Writes uploads' arrays into their host fields (uploads_layout; after wait_writable) and binds their device
    views: valid once the upload that covers them has run."""
    uploads.write([staging.host(f) for f in fields])
    uploads.bind([staging.device_view(f) for f in fields])


class StagingBuffer:
    """A host byte buffer (pinned on CUDA) and its device twin of the same capacity. Fields are written on the host
    (`host`), read on the device (`device`), and `upload(nbytes)` copies the first nbytes across in one copy, ordered
    on the current stream before any kernel issued after it. The device twin never moves: views of it may be
    captured in CUDA graphs."""

    def __init__(self, capacity: int, device: torch.device, counter: CopyCounter) -> None:
        capacity = max(ALIGN, -(-capacity // ALIGN) * ALIGN)
        cuda = device.type == "cuda"
        self.capacity, self.device, self.counter = capacity, device, counter
        self._host = torch.empty(capacity, dtype=torch.uint8, pin_memory=cuda)
        self._device = torch.empty(capacity, dtype=torch.uint8, device=device) if cuda else self._host
        self._host_bytes = self._host.numpy()
        self._uploaded = torch.cuda.Event() if cuda else None
        self._next_upload = 0  # bytes the next upload copies at least (extend_next_upload)

    def host(self, field: Field) -> np.ndarray:
        """The field's host array (write it before `upload`; valid until the next wait_writable)."""
        return self._host_bytes[field.offset:field.offset + field.nbytes].view(field.dtype)

    def device_view(self, field: Field) -> torch.Tensor:
        """The field's device tensor (what the forward reads once `upload` has run)."""
        raw = self._device[field.offset:field.offset + field.nbytes]
        return raw.view(_TORCH_DTYPES[field.dtype])

    def wait_writable(self) -> None:
        """Block until the last upload has read the host buffer (CUDA: its copy may still be in flight)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def extend_next_upload(self, nbytes: int) -> None:
        """Make the next `upload` copy at least the first nbytes (fields written behind another caller's)."""
        self._next_upload = max(self._next_upload, nbytes)

    def upload(self, nbytes: int) -> None:
        """Copy the host buffer's first nbytes (or more, extend_next_upload) to the device twin: one copy,
        counted."""
        nbytes, self._next_upload = max(nbytes, self._next_upload), 0
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit a staging buffer of {self.capacity}")
        self.counter.host_to_device += 1
        if self._uploaded is None:
            return
        self._device[:nbytes].copy_(self._host[:nbytes], non_blocking=True)
        self._uploaded.record()


class StepIO:
    """A runner's staging buffer for eager steps (grown when a step needs more) and the way back for its sampled
    ids. Every host <-> device copy of a step goes through here (the decode graphs' own buffer shares the counter)."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self.copies = CopyCounter()
        self.staging = StagingBuffer(capacity, device, self.copies)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._landing: dict[torch.dtype, LandingRing] = {}  # per dtype, the pinned tensors the results land in

    def staging_for(self, nbytes: int) -> StagingBuffer:
        """The eager staging buffer, grown (doubled) first when nbytes do not fit."""
        if nbytes > self.staging.capacity:
            self.staging.wait_writable()
            self.staging = StagingBuffer(max(nbytes, 2 * self.staging.capacity), self.device, self.copies)
        return self.staging

    def buffer(self, capacity: int) -> StagingBuffer:
        """A fixed staging buffer counted with this one (the decode graphs' static inputs), with APPENDED_ROOM
        bytes past capacity for a step's sampling inputs."""
        return StagingBuffer(capacity + APPENDED_ROOM, self.device, self.copies)

    def upload_alone(self, uploads: Uploads) -> None:
        """Sampling inputs made outside a step (a Sampler called on its own), in one upload of their own through
        the eager buffer; binds their device views. Nothing is copied when there are none."""
        if not len(uploads):
            return
        fields, end = uploads_layout(uploads, 0)
        staging = self.staging_for(end)
        staging.wait_writable()
        stage_uploads(staging, fields, uploads)
        staging.upload(end)

    def to_host(self, values: torch.Tensor) -> list:
        """values (1-D, on the device) as a host list: start_to_host(values).wait()."""
        return self.start_to_host(values).wait()

    def start_to_host(self, values: torch.Tensor) -> HostCopy:
        """Start the one device-to-host copy of values (1-D, on the device), counted; wait() gives the list. On CUDA
        the copy runs on a side stream once the current stream has produced values, into the next of a ring of
        pinned buffers (an async engine has at most two copies outstanding), and wait() waits for its event only."""
        self.copies.device_to_host += 1
        if self._stream is None:
            return HostCopy(values, values.numel(), None)
        landing = self._landing_for(values.dtype, values.numel())
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            landing[:values.numel()].copy_(values, non_blocking=True)
            values.record_stream(self._stream)
            copied = torch.cuda.Event()
            copied.record()
        return HostCopy(landing, values.numel(), copied)

    def _landing_for(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The next pinned buffer of dtype's ring, at least numel long (grown in place when it is not)."""
        return self._landing.setdefault(dtype, LandingRing(dtype, pin_memory=True)).next(numel)
