"""The message order of one transfer: one TRANSFER frame out and one STATUS frame back on the pair's control
connection (kv_transfer/control/), the bytes on the pair's process group (PairChannel) in between.

  sender                                      receiver
  TRANSFER {seq, manifest, direct flags} ---> decode, check fingerprint, cancel list, allocate blocks
                                              (declined: STATUS now, and the epoch's group is closed:
                                               the sender's data, already on its way, is not read)
  whole request: per run, its 2L planes (direct) or its gathered piece, back to back, no control words
  layer-streamed: per layer, as the step writes it: int64 NEXT_RUN, the layer's bytes of every block,
                  int64 checksum; then int64 COMMIT (or ABORT at any layer), int64 tail length, tail bytes
                                              each piece landed as it completes (checksum, scatter)
                     <----------------------- STATUS {seq, final status, whether the epoch's group lives}
  frees its blocks                            delivers (manifest, own block ids) or frees its blocks

The go-ahead is the TRANSFER frame itself: the sender does not wait for an accept before the bytes go.
A receiver that gives up on a transfer before all of its bytes were read closes the group (STATUS says
so: alive False) and the sender opens the next epoch's group before its next transfer.
"""
from __future__ import annotations

import time
from concurrent.futures import Executor
from typing import Callable

import numpy as np
import torch

from kv_transfer.control.connection import ControlConnection, Kind
from kv_transfer.control.exchange import Declined, TransferFrame, answer_manifest, await_status, land_and_settle
from kv_transfer.dist.channel import PairChannel
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest import Manifest
from kv_transfer.outgoing import OutgoingTransfer
from kv_transfer.pool import KVPoolView
from kv_transfer.results import CancelFlag, ReceiveInbox
from kv_transfer.staging import StagingPool
from kv_transfer.status import KVTransferError, TransferStatus
from kv_transfer.stream_tail import MAX_TAIL_BYTES

COMMIT, NEXT_RUN, ABORT, NEXT_PLANES = 0, 1, 2, 3
_U64_MASK = (1 << 64) - 1


def _post_run(channel: PairChannel, outgoing: OutgoingTransfer, index: int) -> list:
    """Posts run `index`: NEXT_PLANES + its 2 * num_layers pool planes (direct), or NEXT_RUN + its
    gathered staging piece (the planes grouped where the backend groups them). Returns the works to wait for."""
    control = NEXT_PLANES if outgoing.direct[index] else NEXT_RUN
    return [channel.post_send(channel.code_tensor(control))] + channel.post_sends(outgoing.pieces(index))


def _stream_stop(step: Callable[[], object]) -> KVTransferError | None:
    """Runs a step that waits for a streamed layer or tail; the error that stops the stream, if any (the
    link itself is fine then: the caller sends ABORT)."""
    try:
        step()
    except KVTransferError as exc:
        return exc
    return None


def send_runs(channel: PairChannel, outgoing: OutgoingTransfer, deadline: float,
              cancel: CancelFlag) -> KVTransferError | None:
    """Sends every piece, each announced by its control word (and followed by its checksum when streamed),
    gathering piece i+1 (unless direct) while piece i is on the wire; then COMMIT (+ a streamed transfer's
    tail). Stops with ABORT if cancel is set or the stream stops (its step failed, its first token ended
    the request). None if everything went, else why not."""
    stop = _stream_stop(lambda: outgoing.gather(0))
    for index in range(outgoing.num_pieces):
        if cancel.is_set() or stop is not None:
            channel.send_code(ABORT, deadline)
            return stop or KVTransferError(TransferStatus.CANCELLED, "cancelled by the sender")
        works = _post_run(channel, outgoing, index)
        if index + 1 < outgoing.num_pieces:
            stop = _stream_stop(lambda: outgoing.gather(index + 1))
        for work in works:
            channel.wait(work, deadline, "send")
        if outgoing.stream is not None:
            channel.send_code(to_int64(outgoing.checksum(index)), deadline)
    tail: list[bytes | None] = [None]
    stop = stop or _stream_stop(lambda: tail.__setitem__(0, outgoing.tail()))
    if cancel.is_set() or stop is not None:
        channel.send_code(ABORT, deadline)
        return stop or KVTransferError(TransferStatus.CANCELLED, "cancelled by the sender")
    channel.send_code(COMMIT, deadline)
    if tail[0] is not None:
        _send_bytes(channel, tail[0], deadline)
    return None


def _send_bytes(channel: PairChannel, data: bytes, deadline: float) -> None:
    payload = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).to(channel.device)
    channel.send_code(payload.numel(), deadline)
    channel.send(payload, deadline)


def to_int64(value: int) -> int:
    """A uint64 (a checksum) as the int64 a control word carries."""
    return value - (1 << 64) if value >= 1 << 63 else value


def send_pieces(channel: PairChannel, outgoing: OutgoingTransfer, deadline: float) -> None:
    """A whole-request transfer's bytes: every run's planes or gathered piece, back to back, gathering piece
    i+1 (unless direct) while piece i is on the wire; on a group that coalesces (NCCL), every piece gathered
    first and all of them sent as one grouped operation. Raises KVTransferError when the link fails."""
    if channel.coalesces:
        outgoing.gather_all()
        for work in channel.post_sends([t for index in range(outgoing.num_pieces) for t in outgoing.pieces(index)]):
            channel.wait(work, deadline, "send")
        return
    outgoing.gather(0)
    for index in range(outgoing.num_pieces):
        works = channel.post_sends(outgoing.pieces(index))
        if index + 1 < outgoing.num_pieces:
            outgoing.gather(index + 1)
        for work in works:
            channel.wait(work, deadline, "send")


def send_transfer(conn: ControlConnection, channel: PairChannel, outgoing: OutgoingTransfer, seq: int,
                  deadline: float, cancel: CancelFlag) -> None:
    """The whole sender side: the TRANSFER frame, the bytes, the STATUS reply. Returns when the receiver
    has landed everything (OK); raises KVTransferError otherwise. A group the receiver closed leaves this
    channel broken, so the caller opens the next epoch. A cancel stops a layer-streamed transfer at its
    next layer (ABORT); a whole-request transfer, whose bytes go at once, runs to its end."""
    rid = outgoing.manifest.request_id
    frame = TransferFrame(seq, outgoing.manifest_bytes, bytes(outgoing.direct) if outgoing.stream is None else b"")
    conn.send(Kind.TRANSFER, frame.encode(), deadline)
    stopped: KVTransferError | None = None
    try:
        if outgoing.stream is None:
            send_pieces(channel, outgoing, deadline)
        else:
            stopped = send_runs(channel, outgoing, deadline, cancel)
    except KVTransferError as exc:  # the data plane failed: the receiver's reply says why, when it can
        final, _ = await_status(conn, seq, deadline)
        raise Declined(final if final != TransferStatus.OK else exc.status, exc.message, rid) from None
    final, alive = await_status(conn, seq, deadline)
    if not alive:
        channel.close()
        channel.mark_broken("the receiver closed this epoch's group")
    if stopped is not None:
        raise Declined(stopped.status, stopped.message, rid)
    if final != TransferStatus.OK:
        raise Declined(final, "receiver reported failure", rid)


def _receive_run(channel: PairChannel, incoming: IncomingTransfer, index: int, control: int, deadline: float) -> None:
    """Receives piece `index` as announced by control (one staging piece, or its planes: straight into this
    side's blocks when they are contiguous), then lands it (a streamed layer once its checksum is in)."""
    if control == NEXT_RUN:
        channel.recv(incoming.payloads[index], deadline)
        streamed = incoming.manifest.streamed
        incoming.landed(index, checksum=channel.recv_code(deadline) & _U64_MASK if streamed else None)
        return
    if incoming.manifest.streamed:
        raise KVTransferError(TransferStatus.MALFORMED, "a streamed layer announced as planes",
                              incoming.manifest.request_id)
    targets, in_place = incoming.plane_targets(index, channel.device)
    works = channel.post_recvs(targets)
    for work in works:
        channel.wait(work, deadline, "recv")
    incoming.landed(index, in_place=in_place)


def receive_runs(channel: PairChannel, incoming: IncomingTransfer, deadline: float) -> bool:
    """Receives pieces (landing each as it completes) until COMMIT (True; a streamed transfer's tail follows
    it) or ABORT (False)."""
    rid = incoming.manifest.request_id
    for index in range(incoming.num_pieces):
        control = channel.recv_code(deadline)
        if control == ABORT:
            return False
        if control not in (NEXT_RUN, NEXT_PLANES):
            raise KVTransferError(TransferStatus.MALFORMED, f"unexpected control word {control}", rid)
        _receive_run(channel, incoming, index, control, deadline)
    control = channel.recv_code(deadline)
    if control not in (COMMIT, ABORT):
        raise KVTransferError(TransferStatus.MALFORMED, f"unexpected control word {control}", rid)
    if control == COMMIT and incoming.manifest.streamed:
        length = channel.recv_code(deadline)
        if not 0 < length <= MAX_TAIL_BYTES:
            raise KVTransferError(TransferStatus.MALFORMED, f"tail length {length} out of range", rid)
        raw = torch.empty(length, dtype=torch.uint8, device=channel.device)
        channel.recv(raw, deadline)
        incoming.set_tail(raw.cpu().numpy().tobytes())
    return control == COMMIT


def receive_pieces(channel: PairChannel, incoming: IncomingTransfer, direct: bytes, deadline: float) -> bool:
    """A whole-request transfer's pieces: every receive posted up front (gloo takes them back to back; a
    group that coalesces, NCCL's, as one grouped operation), each piece landed as soon as it is in. True:
    all in (the sender commits by sending them all)."""
    rid = incoming.manifest.request_id
    if len(direct) != incoming.num_pieces or any(flag > 1 for flag in direct):
        raise KVTransferError(TransferStatus.MALFORMED, "direct flags do not match the manifest's runs", rid)
    pieces = [incoming.plane_targets(index, channel.device) if direct[index] else ([incoming.payloads[index]], False)
              for index in range(incoming.num_pieces)]
    if channel.coalesces:  # NCCL: every piece in one grouped operation, landed once all are in
        works = channel.post_recvs([t for targets, _ in pieces for t in targets])
        posted = [(works, pieces[0][1])] + [([], in_place) for _, in_place in pieces[1:]]
    else:
        posted = [(channel.post_recvs(targets), in_place) for targets, in_place in pieces]
    for index, (works, in_place) in enumerate(posted):
        for work in works:
            channel.wait(work, deadline, "recv")
        incoming.landed(index, in_place=in_place, inline=index == len(posted) - 1)  # the last: nothing to overlap
    return True


def receive_transfer(conn: ControlConnection, channel: PairChannel | None, frame: TransferFrame, pool: KVPoolView,
                     staging: StagingPool, inbox: ReceiveInbox, timeout_s: float, lander: Executor) -> None:
    """The whole receiver side of one TRANSFER frame; the outcome goes to the inbox and the STATUS reply
    to the sender. A transfer given up before all its bytes were read closes the channel (the sender
    sees alive False). Raises ControlClosed / KVTransferError only when the reply cannot go."""
    deadline = time.monotonic() + timeout_s

    def decline() -> bool:
        if channel is not None:
            channel.close()
            channel.mark_broken("a declined transfer's bytes were not read")
        return False

    def live() -> bool:
        return channel is not None and channel.broken is None

    def accept(manifest: Manifest) -> IncomingTransfer:
        if not live():
            raise KVTransferError(TransferStatus.PEER_FAILED, "no data-plane group on this connection",
                                  manifest.request_id)
        return IncomingTransfer.accept(manifest, pool, staging, lander)

    incoming = answer_manifest(conn, frame, pool, inbox, deadline, accept, decline)
    if incoming is None:
        return
    if incoming.manifest.streamed:
        land = lambda: receive_runs(channel, incoming, deadline)  # noqa: E731
    else:
        land = lambda: receive_pieces(channel, incoming, frame.direct, deadline)  # noqa: E731
    land_and_settle(conn, frame.seq, incoming, inbox, deadline, land, decline)
