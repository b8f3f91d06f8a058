"""The message order of one transfer over a PairChannel; both ends post the same sequence.

  sender                                     receiver
  ring doorbell seq  ----------------------> wakes (the first one also connects the pair)
  int64 manifest length, uint8 manifest ---> decode, check fingerprint, allocate blocks
                     <---------------------- int64 accept code (OK or why not; nothing more follows)
  per run: int64 NEXT_RUN, run bytes ------> recv into staging
      or: int64 NEXT_PLANES, 2L planes ----> recv into own blocks (contiguous) or staging
  (layer-streamed: per layer, as the step writes it: int64 NEXT_RUN, the layer's bytes of every block,
   int64 checksum)
  int64 COMMIT (or ABORT at any piece) ----> verify length + checksum per piece, scatter into own blocks
  (layer-streamed, after COMMIT: int64 tail length, tail bytes: the first token)
                     <---------------------- int64 final status (OK / CHECKSUM_MISMATCH / CANCELLED / ...)
  frees its blocks                            delivers (manifest, own block ids) or frees its blocks
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Executor
from typing import Callable

import numpy as np
import torch

from kv_transfer.dist.channel import PairChannel
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError
from kv_transfer.manifest_decode import decode_manifest
from kv_transfer.outgoing import OutgoingTransfer
from kv_transfer.pool import KVPoolView
from kv_transfer.results import ReceivedKV, ReceiveFailed, ReceiveInbox, ReceiveOutcome
from kv_transfer.staging import StagingPool
from kv_transfer.status import KVTransferError, TransferStatus
from kv_transfer.stream_tail import MAX_TAIL_BYTES

COMMIT, NEXT_RUN, ABORT, NEXT_PLANES = 0, 1, 2, 3
_U64_MASK = (1 << 64) - 1


def send_manifest(channel: PairChannel, outgoing: OutgoingTransfer, deadline: float) -> None:
    """Sends the length prefix and the manifest, then raises KVTransferError if the receiver declines."""
    payload = torch.from_numpy(np.frombuffer(outgoing.manifest_bytes, dtype=np.uint8).copy()).to(channel.device)
    channel.send_code(payload.numel(), deadline)
    channel.send(payload, deadline)
    accepted = channel.recv_code(deadline)
    if accepted != TransferStatus.OK:
        raise KVTransferError(TransferStatus(accepted), "receiver declined the transfer", outgoing.manifest.request_id)


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
              cancel: threading.Event) -> KVTransferError | None:
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


def send_transfer(channel: PairChannel, outgoing: OutgoingTransfer, deadline: float, cancel: threading.Event) -> None:
    """The whole sender side; returns when the receiver has acked OK, raises KVTransferError otherwise."""
    rid = outgoing.manifest.request_id
    send_manifest(channel, outgoing, deadline)
    stopped = send_runs(channel, outgoing, deadline, cancel)
    final = TransferStatus(channel.recv_code(deadline))
    if stopped is not None:
        raise KVTransferError(stopped.status, stopped.message, rid)
    if final != TransferStatus.OK:
        raise KVTransferError(final, "receiver reported failure", rid)


def _receive_manifest(channel: PairChannel, pool: KVPoolView, staging: StagingPool, inbox: ReceiveInbox,
                      deadline: float, lander: Executor) -> IncomingTransfer | None:
    """Reads the manifest and answers accept/decline; None when declined (nothing is held then)."""
    length = channel.recv_code(deadline)
    if not 0 < length <= MAX_MANIFEST_BYTES:  # the stream cannot be trusted past this point
        raise KVTransferError(TransferStatus.MALFORMED, f"manifest length {length} out of range")
    raw = torch.empty(length, dtype=torch.uint8, device=channel.device)
    channel.recv(raw, deadline)
    return answer_manifest(channel, raw.cpu().numpy().tobytes(), pool, inbox, deadline,
                           lambda manifest: IncomingTransfer.accept(manifest, pool, staging, lander))


def answer_manifest(channel: PairChannel, raw: bytes, pool: KVPoolView, inbox: ReceiveInbox, deadline: float,
                    accept: Callable[[Manifest], IncomingTransfer]) -> IncomingTransfer | None:
    """Checks a received manifest against this pool's limits and the cancel list, lets accept() allocate,
    and answers the sender (OK, or why not). None when declined: nothing is held and the failure is in the
    inbox. A link that fails after accept() frees what it allocated before the error is raised."""
    try:  # checked against this pool's limits before anything is allocated
        manifest = decode_manifest(raw, pool.manifest_limits)
        if inbox.is_cancelled(manifest.request_id):
            raise KVTransferError(TransferStatus.CANCELLED, "cancelled by the receiver", manifest.request_id)
        incoming = accept(manifest)
    except (ManifestError, KVTransferError) as exc:
        status = exc.status  # ManifestError: MALFORMED or REJECTED_FINGERPRINT
        channel.send_code(status, deadline)
        inbox.put(ReceiveFailed(getattr(exc, "request_id", ""), status, str(exc)))
        return None
    try:
        channel.send_code(TransferStatus.OK, deadline)
    except KVTransferError as exc:  # the link failed between allocating and accepting: free, then report
        incoming.fail(exc.status, exc.message)
        raise KVTransferError(exc.status, exc.message, manifest.request_id) from None
    return incoming


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


def _receive_runs(channel: PairChannel, incoming: IncomingTransfer, deadline: float) -> bool:
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


def finish_receive(channel: PairChannel, incoming: IncomingTransfer, inbox: ReceiveInbox, committed: bool,
                   deadline: float) -> ReceiveOutcome:
    """Verifies and writes the blocks (or not), then acks the sender with the outcome; frees on any failure."""
    if not committed:
        outcome = incoming.fail(TransferStatus.ABORTED_BY_SENDER, "the sender cancelled the transfer")
    elif inbox.is_cancelled(incoming.manifest.request_id):
        outcome = incoming.fail(TransferStatus.CANCELLED, "cancelled by the receiver")
    else:
        try:
            outcome = incoming.commit()
        except KVTransferError as exc:
            outcome = incoming.fail(exc.status, exc.message)
    status = outcome.status if isinstance(outcome, ReceiveFailed) else TransferStatus.OK
    try:
        channel.send_code(status, deadline)
    except KVTransferError as exc:
        if isinstance(outcome, ReceivedKV):  # the sender will count it as failed: do not keep the blocks
            incoming.pool.free(outcome.block_ids)
            outcome = ReceiveFailed(outcome.request_id, exc.status, f"could not ack the sender: {exc.message}")
        inbox.put(outcome)
        raise
    return outcome


def receive_transfer(channel: PairChannel, pool: KVPoolView, staging: StagingPool, inbox: ReceiveInbox,
                     timeout_s: float, lander: Executor) -> None:
    """The whole receiver side of one announced transfer; the outcome goes to the inbox.
    Raises KVTransferError only when the link itself failed (after freeing whatever it held)."""
    deadline = time.monotonic() + timeout_s
    try:
        incoming = _receive_manifest(channel, pool, staging, inbox, deadline, lander)
    except KVTransferError as exc:  # the link failed before we learnt which request this was
        inbox.put(ReceiveFailed(exc.request_id, exc.status, exc.message))
        raise
    if incoming is None:
        return
    land_and_settle(channel, incoming, inbox, deadline, lambda: _receive_runs(channel, incoming, deadline))


def land_and_settle(channel: PairChannel, incoming: IncomingTransfer, inbox: ReceiveInbox, deadline: float,
                    land_runs: Callable[[], bool]) -> None:
    """Lands an accepted transfer's runs with land_runs() (True: the sender committed), then verifies and
    acks it (finish_receive); the outcome goes to the inbox. Any failure frees what the transfer holds
    first; a failure of the link itself is raised after that."""
    try:
        committed = land_runs()
    except KVTransferError as exc:
        inbox.put(incoming.fail(exc.status, exc.message))
        raise
    except BaseException as exc:
        inbox.put(incoming.fail(TransferStatus.INTERNAL, f"{type(exc).__name__}: {exc}"))
        raise
    inbox.put(finish_receive(channel, incoming, inbox, committed, deadline))
