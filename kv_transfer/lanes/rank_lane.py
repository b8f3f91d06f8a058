"""One rank's lane: a KVSender or KVReceiver over that rank's own pool (its KV heads only), whose blocks belong to
the group's rank 0. A lane never frees a block (its pool view's free does nothing): rank 0 frees a request's blocks
once every rank's lane of it ended (kv_transfer/lanes/group_sender.py, group_receiver.py).

LaneSpec is what a group's ranks are started with: rank 0 builds its own lane from it (`lane`), each follower runs
it as the engine's rank service (`__call__`: the lane plus its link to rank 0, FollowerLane).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.config import DistRendezvous, ReceiverAddress, TransferConfig
from kv_transfer.factory import create_receiver, create_sender
from kv_transfer.lanes.hub import FollowerLink, HubAddress
from kv_transfer.lanes.messages import EndStream, Expect, Forget, ForgetPeer, Hello, LaneEnded, SetPeer, Ship
from kv_transfer.layer_stream import LayerClock, LayerStream
from kv_transfer.pool import KVPoolView
from kv_transfer.results import ReceiveFailed, ReceiveOutcome, SendRequest, TransferHandle
from kv_transfer.status import KVTransferError, TransferStatus

Ended = Callable[[str, TransferStatus, str], None]  # (request_id, status, message): once per lane transfer


def _refuse(num_blocks: int) -> None:
    return None  # a lane allocates nothing itself


def _keep(block_ids: Sequence[int]) -> None:
    """Rank 0 owns a lane's blocks: nothing is freed here."""


def lane_address(peer: ReceiverAddress, rank: int) -> ReceiverAddress:
    """The address of rank `rank`'s lane of a group receiver (peer.lanes[rank])."""
    return ReceiverAddress(peer.transport, peer.rank, peer.lanes[rank])


class SendLane:
    """Ships this rank's heads of a request's blocks to the decode rank of the same index."""

    def __init__(self, spec: "LaneSpec", kv: torch.Tensor, kv_heads: tuple[int, int]) -> None:
        view = KVPoolView(kv, _refuse, _keep, kv_heads=kv_heads)
        self.sender = create_sender(spec.config, view, spec.transport, spec.rendezvous)
        self._handles: dict[str, TransferHandle] = {}
        self._lock = threading.Lock()

    def ship(self, peer: ReceiverAddress, request: SendRequest, ended: Ended) -> None:
        """Starts the transfer; ended(...) runs once when it ends (on a transport thread, or here if it cannot
        start)."""
        try:
            handle = self.sender.send(peer, request)
        except (ValueError, KVTransferError) as exc:
            ended(request.request_id, getattr(exc, "status", TransferStatus.INTERNAL), str(exc))
            return
        with self._lock:
            self._handles[request.request_id] = handle
        handle.add_done_callback(lambda done: self._ended(done, ended))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            handle = self._handles.get(request_id)
        if handle is not None:
            handle.cancel()

    def _ended(self, handle: TransferHandle, ended: Ended) -> None:
        with self._lock:
            self._handles.pop(handle.request_id, None)
        error = handle.exception()
        if error is None:
            ended(handle.request_id, TransferStatus.OK, "")
        else:
            ended(handle.request_id, getattr(error, "status", TransferStatus.INTERNAL), str(error))

    def close(self) -> None:
        self.sender.close()


class ReceiveLane:
    """Takes this rank's heads of each request into the blocks rank 0 reserved for it (allocate_for(request_id, n)
    says which) and hands every transfer's outcome to deliver(outcome) (on a transport thread; must not block)."""

    def __init__(self, spec: "LaneSpec", kv: torch.Tensor, kv_heads: tuple[int, int],
                 allocate_for: Callable[[str, int], list[int] | None],
                 deliver: Callable[[ReceiveOutcome], None],
                 released: Callable[[Sequence[int]], None] = _keep) -> None:
        """released(block_ids): a failed transfer gives back the blocks allocate_for gave it (rank 0 frees them)."""
        view = KVPoolView(kv, _refuse, released, allocate_for, kv_heads=kv_heads)
        self.receiver = create_receiver(spec.config, view, spec.transport, spec.rendezvous, spec.peers, spec.host)
        self.receiver.deliver_to(deliver)

    @property
    def target(self) -> str:
        return self.receiver.address.target

    def close(self) -> None:
        self.receiver.close()


def ending(outcome: ReceiveOutcome) -> tuple[str, TransferStatus, str]:
    """(request_id, status, message) of a receive's outcome."""
    if isinstance(outcome, ReceiveFailed):
        return outcome.request_id, outcome.status, outcome.message
    return outcome.request_id, TransferStatus.OK, ""


EXPECT_WAIT_S = 5.0  # at most this long a follower's lane waits for rank 0's Expect (rank 0's own lane is late)


class ExpectedBlocks:
    """A decode follower's blocks per request as rank 0's Expect named them: a lane's transfer takes them (waiting up
    to wait_s for the Expect, which comes once rank 0's own lane of the request has arrived: about as soon as this
    one); Forget drops one not yet taken. The wait holds the transport's thread that accepts the transfer (a gRPC
    receiver's event loop: EXPECT_WAIT_S bounds it)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._blocks: dict[str, tuple[int, ...]] = {}
        self._forgotten: dict[str, float] = {}  # request id -> when: a transfer arriving later is refused at once
        self._changed = threading.Condition()

    def expect(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        with self._changed:
            self._forgotten.pop(request_id, None)
            self._blocks[request_id] = block_ids
            self._changed.notify_all()

    def forget(self, request_id: str) -> bool:
        """Drops request_id; True when it had an Expect no transfer took (its end is then the caller's to report)."""
        with self._changed:
            now = time.monotonic()
            self._forgotten = {rid: at for rid, at in self._forgotten.items() if now - at < 600}
            self._forgotten[request_id] = now
            self._changed.notify_all()
            return self._blocks.pop(request_id, None) is not None

    def take(self, request_id: str, num_blocks: int) -> list[int] | None:
        with self._changed:
            self._changed.wait_for(lambda: request_id in self._blocks or request_id in self._forgotten, self.wait_s)
            blocks = self._blocks.pop(request_id, None)
        return list(blocks) if blocks is not None and len(blocks) == num_blocks else None


class StepClocks:
    """A follower's LayerClock per step number, made by whichever comes first: the step's forward (layer_done) or a
    streamed Ship of it (which may come after the step ran: the last KEEP_STEPS steps' clocks are kept)."""

    KEEP_STEPS = 64

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.num_layers, self.device = num_layers, device
        self._clocks: dict[int, LayerClock] = {}
        self._lock = threading.Lock()

    def clock(self, step: int) -> LayerClock:
        with self._lock:
            clock = self._clocks.get(step)
            if clock is None:
                clock = self._clocks[step] = LayerClock(self.num_layers, self.device)
                for old in [number for number in self._clocks if number < step - self.KEEP_STEPS]:
                    del self._clocks[old]
            return clock


@dataclass(frozen=True)
class LaneSpec:
    """How a group's ranks run their lanes: role "send" (a prefill group) or "receive" (a decode group), the
    transport and its config, the rank transports' rendezvous (this worker's rank on the KV plane; every rank of the
    group uses it), the senders a receiver listens to, the host its listeners bind, and rank 0's hub."""

    role: str
    transport: str
    config: TransferConfig
    hub: HubAddress
    rendezvous: DistRendezvous | None = None
    peers: tuple[int, ...] = ()
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.role not in ("send", "receive"):
            raise ValueError(f"a lane's role is 'send' or 'receive', got {self.role!r}")

    def __call__(self, context: Any) -> "FollowerLane":
        """A follower's lane and its link to rank 0: the engine's rank service, context its RankContext
        (engine/parallel/rank_service.py; not imported: kv_transfer does not depend on the engine's runner)."""
        return FollowerLane(self, context)


class FollowerLane:
    """A follower rank's lane, serving rank 0's commands: Ship / EndStream / Forget / ForgetPeer (send), Expect /
    Forget / SetPeer (receive); its layer_done is the follower's report of a lane-streamed step's layers."""

    def __init__(self, spec: LaneSpec, context: Any) -> None:
        self.rank = context.rank
        self.expected = ExpectedBlocks(min(EXPECT_WAIT_S, spec.config.kv_transfer_timeout_s))
        self.clocks = StepClocks(context.kv.shape[0], context.kv.device)
        self._streams: dict[str, tuple[LayerStream, SendRequest]] = {}  # streamed Ships not ended yet
        self._lock = threading.Lock()
        if spec.role == "send":
            self.lane, target = SendLane(spec, context.kv, context.kv_heads), ""
        else:
            self.lane = ReceiveLane(spec, context.kv, context.kv_heads, self.expected.take,
                                    lambda outcome: self._ended(*ending(outcome)))
            target = self.lane.target
        try:
            self.link = FollowerLink(spec.hub, Hello(self.rank, target), self._handle, spec.config.connect_timeout_s)
        except BaseException:
            self.lane.close()
            raise

    def layer_done(self, step: int, layer: int) -> None:
        """RankService.layer_done: the streams of step `step` may send layer `layer`."""
        self.clocks.clock(step).layer_done(layer)

    def _ended(self, request_id: str, status: TransferStatus, message: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self.link.report(LaneEnded(self.rank, request_id, status, message))

    def _ship(self, command: Ship) -> None:
        request = command.request
        if command.stream_step is not None:
            stream = LayerStream(self.clocks.clock(command.stream_step))
            request = dataclasses.replace(request, stream=stream)
            with self._lock:
                self._streams[request.request_id] = (stream, request)
        self.lane.ship(command.peer, request, self._ended)

    def _end_stream(self, command: EndStream) -> None:
        with self._lock:
            stream, request = self._streams.get(command.request_id, (None, None))
        if stream is None:
            return
        if command.tail is not None:
            stream.finish(command.tail, request.block_ids)  # rank 0 owns the blocks: the lane frees nothing
        else:
            stream.abort(command.reason)

    def _handle(self, command: object) -> None:
        if isinstance(command, Ship):
            self._ship(command)
        elif isinstance(command, EndStream):
            self._end_stream(command)
        elif isinstance(command, Expect):
            self.expected.expect(command.request_id, command.block_ids)
        elif isinstance(command, Forget):
            if isinstance(self.lane, SendLane):
                self.lane.cancel(command.request_id)
            elif self.expected.forget(command.request_id):  # no transfer took it: that is how it ended
                self._ended(command.request_id, TransferStatus.CANCELLED, "forgotten before its KV came")
            else:
                self.lane.receiver.cancel(command.request_id)
        elif isinstance(command, ForgetPeer):
            self.lane.sender.forget_peer(command.peer)
        elif isinstance(command, SetPeer):
            (self.lane.receiver.add_peer if command.listen else self.lane.receiver.remove_peer)(command.rank)

    def close(self) -> None:
        self.lane.close()
        self.link.close()
