"""A point-to-point data link between one sender rank and one receiver rank over torch.distributed.

Each (sender, receiver, lane) pair has one authenticated control connection (kv_transfer/control/) and,
over it, a private 2-rank process group (gloo on CPU tensors, nccl on CUDA tensors): the group meets
through a PairStore on that connection (no open TCPStore), and its gloo device binds the address the
connection uses. Every wait has a deadline; after any failed or timed-out operation the channel is broken
for good (gloo closes the pair on a timeout) and every later call raises KVTransferError(PEER_FAILED) at
once. A pair survives that: each channel is one *epoch* of the connection, and after a break the sender
asks for the next epoch's group (a CONNECT frame), so one failed or slow transfer fails only itself
(kv_transfer/dist/transport.py).
The planes of a run go out as one grouped operation where the process group coalesces point-to-point
calls (NCCL: one group, one launch, like batch_isend_irecv); gloo does not, and posts them one by one.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from kv_transfer.control.connection import ControlConnection
from kv_transfer.control.pair_store import PairStore
from kv_transfer.status import KVTransferError, TransferStatus

logger = logging.getLogger("tandem.kv_transfer.dist")
SENDER, RECEIVER = 0, 1


class PairChannel:
    """One epoch's process group between the two ends of one pair. Not thread-safe: one thread per end."""

    def __init__(self, backend: str, role: int, device: torch.device, connect_timeout_s: float,
                 transfer_timeout_s: float = 0.0, epoch: int = 0, name: str = "kv link"):
        """transfer_timeout_s: the transfer deadline the caller enforces itself; an NCCL group's own timeout
        is longer (connect + transfer), so that only our deadlines ever end an operation."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"PairChannel backend must be gloo or nccl, got {backend!r}")
        self.backend, self.role, self.epoch = backend, role, epoch
        self.prefix = f"{name} epoch {epoch}"
        self.device = torch.device(device)
        self.connect_timeout_s = connect_timeout_s
        self.group_timeout_s = connect_timeout_s + transfer_timeout_s
        self._group: dist.ProcessGroup | None = None
        self._coalesces: bool | None = None  # whether the group groups point-to-point calls (found on first use)
        self._broken: str | None = None

    # --- process group ---
    def connect(self, conn: ControlConnection) -> None:
        """Builds the pair's process group through a PairStore on conn; blocks until the other end does the
        same (the sender sends CONNECT first, the receiver calls this when it reads it). Nothing else may
        travel on conn meanwhile. Raises KVTransferError (the channel is then broken)."""
        if self._group is not None:
            return
        store = PairStore(conn, self.connect_timeout_s)
        try:
            if self.backend == "gloo":  # connects here, within connect_timeout_s; ops get our own deadlines
                options = dist.ProcessGroupGloo._Options()
                options._timeout = timedelta(seconds=self.connect_timeout_s)
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=conn.local_host)]
                self._group = dist.ProcessGroupGloo(store, self.role, 2, options)
            else:  # NCCL's watchdog aborts what outlives the group timeout: longer than any transfer deadline
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timedelta(seconds=self.group_timeout_s)
                self._group = dist.ProcessGroupNCCL(store, self.role, 2, options)
                self._warm_nccl()  # NCCL connects lazily, through the store: now, while nothing else travels
        except KVTransferError as exc:
            self._break(f"could not connect: {exc.message}", exc.status)
        except Exception as exc:
            self._break(f"could not connect: {exc}")

    def _warm_nccl(self) -> None:
        box = self.code_tensor(0)
        deadline = time.monotonic() + self.connect_timeout_s
        self.wait(self.post_send(box) if self.role == SENDER else self.post_recv(box), deadline, "connect")

    @property
    def peer(self) -> int:
        return 1 - self.role

    def send(self, tensor: torch.Tensor, deadline: float) -> None:
        """Sends tensor to the other end; returns once it went out, raises KVTransferError otherwise."""
        self.wait(self.post_send(tensor), deadline, "send")

    def recv(self, tensor: torch.Tensor, deadline: float) -> None:
        """Receives the other end's next message into tensor (same size); raises KVTransferError."""
        self.wait(self.post_recv(tensor), deadline, "recv")

    def post_recv(self, tensor: torch.Tensor) -> dist.Work:
        """Starts receiving the other end's next message into tensor (untouched until wait() on the work).
        Posted receives are matched to the other end's sends in posting order."""
        group = self._live_group()
        return self._post(lambda: group.recv([tensor], self.peer, 0), "recv")

    def post_send(self, tensor: torch.Tensor) -> dist.Work:
        """Starts sending tensor (which must stay untouched until wait() on the returned work)."""
        group = self._live_group()
        return self._post(lambda: group.send([tensor], self.peer, 0), "send")

    def post_sends(self, tensors: Sequence[torch.Tensor]) -> list[dist.Work]:
        """Starts sending tensors, in order, as one grouped operation where the process group coalesces
        point-to-point calls (NCCL), else one by one. Returns the works to wait for; the tensors must stay
        untouched until then."""
        return self._post_many(tensors, "send")

    def post_recvs(self, tensors: Sequence[torch.Tensor]) -> list[dist.Work]:
        """Starts receiving the other end's next len(tensors) messages into tensors, grouped as post_sends."""
        return self._post_many(tensors, "recv")

    def _post_many(self, tensors: Sequence[torch.Tensor], what: str) -> list[dist.Work]:
        group = self._live_group()
        post = group.send if what == "send" else group.recv
        if len(tensors) < 2 or not self._coalescing(group):
            return [self._post(lambda t=t: post([t], self.peer, 0), what) for t in tensors]

        def grouped() -> dist.Work:
            group._start_coalescing()
            for tensor in tensors:
                post([tensor], self.peer, 0)
            return group._end_coalescing()
        return [self._post(grouped, what)]

    @property
    def coalesces(self) -> bool:
        """Whether this channel's group takes many point-to-point calls as one grouped operation (NCCL)."""
        return self._coalescing(self._live_group())

    def _coalescing(self, group) -> bool:
        """Whether `group` groups point-to-point calls: it says so and starting a group works (a torch whose
        backend binding differs falls back to one call per tensor, once, with a warning)."""
        if self._coalesces is None:
            self._coalesces = bool(getattr(group, "supports_coalescing", False))
            if self._coalesces:
                try:
                    group._start_coalescing()
                    group._end_coalescing()
                except Exception as exc:  # noqa: BLE001 - no grouping then; each call goes alone
                    logger.warning("link %s: %s does not group point-to-point calls here (%s); one call per "
                                   "tensor", self.prefix, self.backend, exc)
                    self._coalesces = False
        return self._coalesces

    def code_tensor(self, code: int) -> torch.Tensor:
        """A control word as the one-element int64 tensor that travels."""
        return torch.tensor([code], dtype=torch.int64, device=self.device)

    def send_code(self, code: int, deadline: float) -> None:
        self.send(self.code_tensor(code), deadline)

    def recv_code(self, deadline: float) -> int:
        box = torch.empty(1, dtype=torch.int64, device=self.device)
        self.recv(box, deadline)
        return int(box.item())

    def close(self) -> None:
        """Drops the process group (the peer's pending operations fail with 'connection closed')."""
        group, self._group = self._group, None
        if group is not None and self.backend == "nccl":
            group.abort()
        del group

    @property
    def broken(self) -> str | None:
        """Why this epoch's group is unusable (None while it works)."""
        return self._broken

    def mark_broken(self, reason: str) -> None:
        """Marks the channel unusable (after close(): the other end closed or will close its group)."""
        if self._broken is None:
            self._broken = reason

    def _live_group(self) -> dist.ProcessGroup:
        if self._broken is not None:
            raise KVTransferError(TransferStatus.PEER_FAILED, f"link {self.prefix} is broken: {self._broken}")
        if self._group is None:
            raise KVTransferError(TransferStatus.INTERNAL, f"link {self.prefix} is not connected")
        return self._group

    def _post(self, post: Callable[[], dist.Work], what: str) -> dist.Work:
        try:
            return post()
        except Exception as exc:
            self._fail(exc, what, timed_out=False)

    def wait(self, work: dist.Work, deadline: float, what: str) -> None:
        """Waits for a posted operation until deadline; any failure or timeout breaks the link."""
        try:
            if self.backend == "nccl":
                self._await_nccl(work, deadline)
            else:
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except Exception as exc:
            self._fail(exc, what, timed_out=time.monotonic() >= deadline or "timed out" in str(exc).lower())

    def _fail(self, exc: Exception, what: str, timed_out: bool) -> NoReturn:
        status = TransferStatus.TIMEOUT if timed_out else TransferStatus.PEER_FAILED
        self._break(f"{what} failed: {str(exc).splitlines()[0][:300]}", status)

    def _await_nccl(self, work: dist.Work, deadline: float) -> None:
        """NCCL work completes on the GPU; poll it from the host so a dead peer cannot hang us."""
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise TimeoutError("nccl operation timed out")
            time.sleep(0.0002)
        work.wait()

    def _break(self, reason: str, status: TransferStatus = TransferStatus.PEER_FAILED) -> NoReturn:
        self._broken = reason
        self.close()
        raise KVTransferError(status, f"link {self.prefix}: {reason}")
