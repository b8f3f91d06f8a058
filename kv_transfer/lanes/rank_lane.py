"""One rank's lane: a KVSender or KVReceiver over that rank's own pool (its KV heads only), whose blocks belong to
the group's rank 0. A lane never frees a block (its pool view's free does nothing): rank 0 frees a request's blocks
once every rank's lane of it ended (kv_transfer/lanes/group_sender.py, group_receiver.py).

LaneSpec is what a group's ranks are started with: rank 0 builds its own lane from it (`lane`), each follower runs
it as the engine's rank service (`__call__`: the lane plus its link to rank 0, FollowerLane).
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.config import DistRendezvous, ReceiverAddress, TransferConfig
from kv_transfer.connector import KVSender
from kv_transfer.factory import create_receiver, create_sender
from kv_transfer.lanes.assembly import PartAssembler
from kv_transfer.lanes.follower_state import EXPECT_WAIT_S, ExpectedBlocks, StepClocks
from kv_transfer.lanes.hub import FollowerLink, HubAddress
from kv_transfer.lanes.messages import EndStream, Expect, Forget, ForgetPeer, Hello, LaneEnded, SetPeer, Ship
from kv_transfer.layer_stream import LayerStream
from kv_transfer.pool import KVPoolView
from kv_transfer.results import ReceiveFailed, ReceiveOutcome, SendRequest, TransferHandle
from kv_transfer.status import KVTransferError, TransferStatus

Ended = Callable[[str, TransferStatus, str], None]  # (request_id, status, message): once per lane transfer
Span = tuple[int, int]


def _refuse(num_blocks: int) -> None:
    return None  # a lane allocates nothing itself


def _keep(block_ids: Sequence[int]) -> None:
    """Rank 0 owns a lane's blocks: nothing is freed here."""


def lane_address(peer: ReceiverAddress, rank: int) -> ReceiverAddress:
    """The address of rank `rank`'s lane of a group receiver (peer.lanes[rank])."""
    return ReceiverAddress(peer.transport, peer.rank, peer.lanes[rank])


class SendLane:
    """Ships heads of a request's blocks from this rank's pool to a receiving rank's lane: all of this rank's heads
    from its pool, or some of them (a part, kv_transfer/lanes/parts.py) from its pool narrowed to them (a sender of
    its own per set of heads, made at its first part)."""

    def __init__(self, spec: "LaneSpec", kv: torch.Tensor, kv_heads: Span) -> None:
        self.spec, self.view = spec, KVPoolView(kv, _refuse, _keep, kv_heads=kv_heads)
        self.sender = create_sender(spec.config, self.view, spec.transport, spec.rendezvous)
        self._window_senders: dict[Span, KVSender] = {}
        self._handles: dict[tuple[str, int], TransferHandle] = {}  # (request id, part) -> its transfer
        self._lock = threading.Lock()

    def _sender_for(self, heads: Span) -> KVSender:
        if heads == self.view.heads:
            return self.sender
        with self._lock:
            sender = self._window_senders.get(heads)
            if sender is None:
                window = KVPoolView(self.view.head_window(heads), _refuse, _keep, kv_heads=heads)
                sender = self._window_senders[heads] = create_sender(self.spec.config, window, self.spec.transport,
                                                                     self.spec.rendezvous)
            return sender

    def ship(self, peer: ReceiverAddress, request: SendRequest, ended: Ended, heads: Span | None = None,
             part: int = 0) -> None:
        """Starts part `part` of request: heads `heads` (default: all of this rank's) to peer; ended(...) runs once
        when it ends (on a transport thread, or here if it cannot start)."""
        try:
            handle = self._sender_for(heads or self.view.heads).send(peer, request)
        except (ValueError, KVTransferError) as exc:
            ended(request.request_id, getattr(exc, "status", TransferStatus.INTERNAL), str(exc))
            return
        with self._lock:
            self._handles[(request.request_id, part)] = handle
        handle.add_done_callback(lambda done: self._ended(done, part, ended))

    def cancel(self, request_id: str) -> None:
        """Cancels every part of request_id under way here."""
        with self._lock:
            handles = [handle for (rid, _), handle in self._handles.items() if rid == request_id]
        for handle in handles:
            handle.cancel()

    def _ended(self, handle: TransferHandle, part: int, ended: Ended) -> None:
        with self._lock:
            self._handles.pop((handle.request_id, part), None)
        error = handle.exception()
        if error is None:
            ended(handle.request_id, TransferStatus.OK, "")
        else:
            ended(handle.request_id, getattr(error, "status", TransferStatus.INTERNAL), str(error))

    def forget_peer(self, peer: ReceiverAddress) -> None:
        for sender in [self.sender, *self._window_senders.values()]:
            sender.forget_peer(peer)

    def close(self) -> None:
        with self._lock:
            senders = [self.sender, *self._window_senders.values()]
        for sender in senders:
            sender.close()


class ReceiveLane:
    """Takes this rank's heads of each request, in one part or several (PartAssembler), into the blocks rank 0
    reserved for it (allocate_for(request_id, n) says which, once per request) and hands each request's outcome to
    deliver(outcome) once (on a transport thread; must not block)."""

    def __init__(self, spec: "LaneSpec", kv: torch.Tensor, kv_heads: Span,
                 allocate_for: Callable[[str, int], list[int] | None],
                 deliver: Callable[[ReceiveOutcome], None],
                 released: Callable[[Sequence[int]], None] = _keep, allocation_waits: bool = False) -> None:
        """released(block_ids): a failed request gives back the blocks allocate_for gave it (rank 0 frees them).
        allocation_waits: allocate_for may block (a follower's waits for rank 0's Expect)."""
        self.parts = PartAssembler(kv, kv_heads, allocate_for, deliver, released,
                                   failed_ttl_s=2 * spec.config.kv_transfer_timeout_s,
                                   allocation_waits=allocation_waits)
        self.receiver = create_receiver(spec.config, self.parts.pool, spec.transport, spec.rendezvous, spec.peers,
                                        spec.host)
        self.receiver.deliver_to(self.parts.outcome)

    @property
    def target(self) -> str:
        return self.receiver.address.target

    def cancel(self, request_id: str) -> None:
        """Drops request_id: its parts under way are cancelled, a later one refused; it ends (once) as they end."""
        self.parts.forget(request_id)
        self.receiver.cancel(request_id)

    def close(self) -> None:
        self.receiver.close()


def ending(outcome: ReceiveOutcome) -> tuple[str, TransferStatus, str]:
    """(request_id, status, message) of a receive's outcome."""
    if isinstance(outcome, ReceiveFailed):
        return outcome.request_id, outcome.status, outcome.message
    return outcome.request_id, TransferStatus.OK, ""


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
        self._streams: dict[tuple[str, int], tuple[LayerStream, SendRequest]] = {}  # streamed parts not ended yet
        self._lock = threading.Lock()
        if spec.role == "send":
            self.lane, target = SendLane(spec, context.kv, context.kv_heads), ""
        else:
            self.lane = ReceiveLane(spec, context.kv, context.kv_heads, self.expected.take,
                                    lambda outcome: self._ended(*ending(outcome)), allocation_waits=True)
            target = self.lane.target
        try:
            self.link = FollowerLink(spec.hub, Hello(self.rank, target, tuple(context.kv_heads)), self._handle,
                                     spec.config.connect_timeout_s)
        except BaseException:
            self.lane.close()
            raise

    def layer_done(self, step: int, layer: int) -> None:
        """RankService.layer_done: the streams of step `step` may send layer `layer`."""
        self.clocks.clock(step).layer_done(layer)

    def _ended(self, request_id: str, status: TransferStatus, message: str, part: int = 0) -> None:
        with self._lock:
            self._streams.pop((request_id, part), None)
        self.link.report(LaneEnded(self.rank, request_id, status, message, part))

    def _ship(self, command: Ship) -> None:
        request, part = command.request, command.part
        if command.stream_step is not None:
            stream = LayerStream(self.clocks.clock(command.stream_step))
            request = dataclasses.replace(request, stream=stream)
            with self._lock:
                self._streams[(request.request_id, part)] = (stream, request)
        self.lane.ship(command.peer, request, lambda rid, status, message: self._ended(rid, status, message, part),
                       command.heads, part)

    def _end_stream(self, command: EndStream) -> None:
        with self._lock:
            streams = [streamed for (rid, _), streamed in self._streams.items() if rid == command.request_id]
        for stream, request in streams:
            if command.tail is not None:
                stream.finish(command.tail, request.block_ids)  # rank 0 owns the blocks: the lane frees nothing
            else:
                stream.abort(command.reason)

    def _forget(self, request_id: str) -> None:
        if isinstance(self.lane, SendLane):
            self.lane.cancel(request_id)
        elif self.expected.forget(request_id):  # no transfer took it: that is how it ended
            self._ended(request_id, TransferStatus.CANCELLED, "forgotten before its KV came")
        else:
            self.lane.cancel(request_id)

    def _handle(self, command: object) -> None:
        if isinstance(command, Ship):
            self._ship(command)
        elif isinstance(command, EndStream):
            self._end_stream(command)
        elif isinstance(command, Expect):
            self.expected.expect(command.request_id, command.block_ids)
        elif isinstance(command, Forget):
            self._forget(command.request_id)
        elif isinstance(command, ForgetPeer):
            self.lane.forget_peer(command.peer)
        elif isinstance(command, SetPeer):
            (self.lane.receiver.add_peer if command.listen else self.lane.receiver.remove_peer)(command.rank)

    def close(self) -> None:
        self.lane.close()
        self.link.close()
