"""TPGroup: the collectives of one tensor-parallel group, over torch.distributed process groups built from a
store (no default process group: several groups, and the KV plane's own, can live in one process). The ranks of
a group share one host, so they meet through a FileStore in a directory only this user can open (no listening
store socket), and gloo binds the loopback address.

Two groups: the device group carries the model's collectives (all-reduce after each row-parallel layer and the
vocab-parallel embedding, the logits gather): NCCL for CUDA tensors, gloo for CPU ones. The control group
carries rank 0's step messages (engine/parallel/step_message.py) on the host: gloo, so a follower waits for the
next step on the CPU. On CPU both are one gloo group, and the all-reduces of tensors up to a slot's size go
through shared memory instead (engine/parallel/host_reduce.py: gloo wakes a sleeping peer per message, ~1.9 ms
an all-reduce on an idle VM). The code is written against the torch.distributed backend API (allreduce /
gather / broadcast), so NCCL runs it unchanged.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.parallel.host_reduce import SharedMemoryReducer

CONNECT_TIMEOUT_S = 120.0
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a forward's collective: a peer gone that long is dead
IDLE_TIMEOUT = timedelta(days=3650)         # a follower waiting for the next step: an idle engine is fine


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one group meet: the FileStore at store_path (in a private directory rank 0 made), keys
    under namespace; on CPU the shared memory file of the all-reduces (shm_path, slots of shm_slot_bytes; ""
    for gloo alone)."""

    store_path: str
    namespace: str
    timeout_s: float = CONNECT_TIMEOUT_S
    shm_path: str = ""
    shm_slot_bytes: int = 0


class TPGroup:
    """Rank `rank` of a `size`-rank group on `device`. Every rank must call the same collectives in the same
    order (followers run rank 0's step, engine/runner/tp_follower.py)."""

    def __init__(self, rank: int, size: int, device: torch.device, device_group, control_group,
                 host_reducer: SharedMemoryReducer | None = None) -> None:
        self.rank, self.size, self.device = rank, size, device
        self._device_group, self._control_group = device_group, control_group
        self._host_reducer = host_reducer

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (x contiguous); returns x."""
        if self._host_reducer is not None and self._host_reducer.fits(x):
            return self._host_reducer.all_reduce_(x)
        self._device_group.allreduce(x).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's x ([..., d] each) concatenated on the last dim, rank order ([..., size * d]);
        the others get None. Logits go to where sampling runs, and nowhere else."""
        parts = self.gather(x)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's x (same shape on every rank), in rank order; the others get None."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        self._device_group.gather(parts, x, 0).wait()
        return parts if self.rank == 0 else None

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x (on the group's device, contiguous) into every rank's x, in place; returns x."""
        self._device_group.broadcast(x, 0).wait()
        return x

    def scatter(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> torch.Tensor:
        """Rank 0's parts[r] (one per rank, each shaped as out, contiguous, on the group's device) into rank r's
        out, in place (parts None on the other ranks); returns out."""
        self._device_group.scatter(out, parts if self.rank == 0 else [], 0).wait()
        return out

    def broadcast_control_(self, buffer: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """Rank 0's host `buffer` into every rank's (same shape and dtype), in place. idle: the caller may wait
        for rank 0 indefinitely (a follower between steps)."""
        timeout = IDLE_TIMEOUT if idle else COLLECTIVE_TIMEOUT
        self._control_group.broadcast(buffer, 0, timeout).wait()
        return buffer

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (the KV blocks all ranks can hold)."""
        cell = torch.tensor([value], dtype=torch.int64)
        self._control_group.allreduce(cell, dist.ReduceOp.MIN).wait()
        return int(cell.item())

    def barrier(self) -> None:
        self.min_int(0)


def connect_group(store: dist.Store, rendezvous: Rendezvous, rank: int, size: int, device: torch.device,
                  peers_alive: Callable[[], bool] = lambda: True) -> TPGroup:
    """Build this rank's groups (blocks until every rank of the group calls it, or rendezvous.timeout_s).
    peers_alive: False once another rank is known dead (a shared-memory wait then stops)."""
    connect = timedelta(seconds=rendezvous.timeout_s)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = max(connect, IDLE_TIMEOUT)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # the ranks share one host
    control = dist.ProcessGroupGloo(dist.PrefixStore(f"{rendezvous.namespace}/control", store), rank, size, options)
    if device.type != "cuda":
        reducer = SharedMemoryReducer(Path(rendezvous.shm_path), rank, size, rendezvous.shm_slot_bytes,
                                      peers_alive) if rendezvous.shm_path else None
        return TPGroup(rank, size, device, control, control, reducer)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = COLLECTIVE_TIMEOUT
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore(f"{rendezvous.namespace}/device", store), rank, size, options)
    return TPGroup(rank, size, device, nccl, control)


def open_store(rendezvous: Rendezvous) -> dist.FileStore:
    """The group's store (every rank opens the same file; -1: no rank deletes it, remove_store does)."""
    store = dist.FileStore(rendezvous.store_path, -1)
    store.set_timeout(timedelta(seconds=rendezvous.timeout_s))
    return store
