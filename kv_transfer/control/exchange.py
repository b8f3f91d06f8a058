"""The control half of every rank transport (gloo, nccl, ipc): one TRANSFER frame from the sender, one
STATUS frame back, on the pair's authenticated ControlConnection. What the receiver does in between (read
the bytes from a process group, or copy them out of a mapped pool) is the transport's part.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from kv_transfer.control.connection import ControlConnection, Kind
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError
from kv_transfer.manifest_decode import decode_manifest
from kv_transfer.pool import KVPoolView
from kv_transfer.results import ReceivedKV, ReceiveFailed, ReceiveInbox
from kv_transfer.status import KVTransferError, TransferStatus

MAX_TRANSFER_FRAME_BYTES = MAX_MANIFEST_BYTES + (1 << 20)  # the manifest, direct flags, an ipc pool handle
MAX_STATUS_FRAME_BYTES = 64


class Declined(KVTransferError):
    """A transfer that failed as the receiver's STATUS reply says: the connection itself is in order."""


@dataclass(frozen=True)
class TransferFrame:
    """What the TRANSFER frame carries: the transfer's number on the connection, the encoded manifest, one
    byte per run (1: the run travels as its planes), an ipc sender's pool handle when it is new, and how many
    raw KV bytes follow the frame on the connection itself (an inline transfer; 0: they take the data plane)."""

    seq: int
    manifest: bytes
    direct: bytes = b""
    pool_handle: bytes | None = None
    inline_nbytes: int = 0

    def encode(self) -> list:
        return [self.seq, self.manifest, self.direct, self.pool_handle, self.inline_nbytes]

    @classmethod
    def decode(cls, payload: object) -> "TransferFrame":
        """Raises KVTransferError MALFORMED unless payload has the frame's shape (the manifest itself is
        decoded against the pool's limits later)."""
        if not (isinstance(payload, list) and len(payload) == 5 and isinstance(payload[0], int)
                and isinstance(payload[1], bytes) and isinstance(payload[2], bytes)
                and (payload[3] is None or isinstance(payload[3], bytes))
                and type(payload[4]) is int and payload[4] >= 0):
            raise KVTransferError(TransferStatus.MALFORMED, "bad TRANSFER frame")
        return cls(*payload)


def send_status(conn: ControlConnection, seq: int, status: TransferStatus, alive: bool, deadline: float) -> None:
    """Receiver: the one reply of a transfer (alive: the data-plane group of this epoch is still usable)."""
    conn.send(Kind.STATUS, [seq, int(status), alive], deadline)


def await_status(conn: ControlConnection, seq: int, deadline: float) -> tuple[TransferStatus, bool]:
    """Sender: reads the reply of transfer seq; (status, whether the receiver's group lives)."""
    _, payload = conn.receive(MAX_STATUS_FRAME_BYTES, deadline, (Kind.STATUS,))
    if not (isinstance(payload, list) and len(payload) == 3 and payload[0] == seq
            and payload[1] in TransferStatus._value2member_map_ and isinstance(payload[2], bool)):
        raise KVTransferError(TransferStatus.MALFORMED, f"bad STATUS frame for transfer {seq}: {payload!r}")
    return TransferStatus._value2member_map_[payload[1]], payload[2]


def answer_manifest(conn: ControlConnection, frame: TransferFrame, pool: KVPoolView, inbox: ReceiveInbox,
                    deadline: float, accept: Callable[[Manifest], IncomingTransfer],
                    decline: Callable[[], bool]) -> IncomingTransfer | None:
    """Checks a received manifest against this pool's limits and the cancel list, and lets accept()
    allocate. None when declined: nothing is held, the failure is in the inbox, decline() has run (it
    stops the bytes the sender may already be sending; it says whether the data plane still lives) and
    the STATUS reply went."""
    try:  # checked against this pool's limits before anything is allocated
        manifest = decode_manifest(frame.manifest, pool.manifest_limits)
        if inbox.is_cancelled(manifest.request_id):
            raise KVTransferError(TransferStatus.CANCELLED, "cancelled by the receiver", manifest.request_id)
        return accept(manifest)
    except (ManifestError, KVTransferError) as exc:
        status = exc.status  # ManifestError: MALFORMED or REJECTED_FINGERPRINT
        inbox.put(ReceiveFailed(getattr(exc, "request_id", ""), status, str(exc)))
        send_status(conn, frame.seq, status, decline(), deadline)
        return None


def cancel_transfer(conn: ControlConnection, seq: int) -> None:
    """Sender, from any thread: asks the receiver to drop transfer seq if it has not delivered it yet (a
    CANCEL frame; the receiver looks for one before it delivers). A closed connection is ignored."""
    try:
        conn.send(Kind.CANCEL, seq, time.monotonic() + 5)
    except KVTransferError:
        pass


def sender_cancelled(conn: ControlConnection, seq: int) -> bool:
    """Receiver, before delivering transfer seq: whether the sender's CANCEL frames waiting on the
    connection name it (CANCELs for earlier transfers came too late and are skipped). Never blocks."""
    while (frame := conn.poll(MAX_STATUS_FRAME_BYTES, (Kind.CANCEL,))) is not None:
        if frame[1] == seq:
            return True
    return False


def finish_receive(conn: ControlConnection, seq: int, incoming: IncomingTransfer, inbox: ReceiveInbox,
                   committed: bool, alive: bool, deadline: float) -> None:
    """Verifies and writes the blocks (or not), then replies STATUS; frees on any failure. The outcome goes
    to the inbox. Raises ControlClosed / KVTransferError when the reply could not go (a delivery is then
    turned into a failure first: the sender counts the transfer as failed and frees its blocks)."""
    if not committed:
        outcome = incoming.fail(TransferStatus.ABORTED_BY_SENDER, "the sender cancelled the transfer")
    elif time.monotonic() > deadline:  # the sender has given up on it by now
        outcome = incoming.fail(TransferStatus.TIMEOUT, "landed past the transfer's deadline")
    elif sender_cancelled(conn, seq):
        outcome = incoming.fail(TransferStatus.CANCELLED, "cancelled by the sender")
    elif inbox.is_cancelled(incoming.manifest.request_id):
        outcome = incoming.fail(TransferStatus.CANCELLED, "cancelled by the receiver")
    else:
        try:
            outcome = incoming.commit()
        except KVTransferError as exc:
            outcome = incoming.fail(exc.status, exc.message)
    status = outcome.status if isinstance(outcome, ReceiveFailed) else TransferStatus.OK
    try:
        send_status(conn, seq, status, alive, deadline)
    except KVTransferError as exc:
        if isinstance(outcome, ReceivedKV):  # the sender will count it as failed: do not keep the blocks
            incoming.pool.free(outcome.block_ids)
            outcome = ReceiveFailed(outcome.request_id, exc.status, f"could not ack the sender: {exc.message}")
        inbox.put(outcome)
        raise
    inbox.put(outcome)


def land_and_settle(conn: ControlConnection, seq: int, incoming: IncomingTransfer, inbox: ReceiveInbox,
                    deadline: float, land_runs: Callable[[], bool], give_up: Callable[[], bool]) -> None:
    """Lands an accepted transfer's pieces with land_runs() (True: the sender committed), then verifies and
    replies (finish_receive). A failure while landing frees what the transfer holds, runs give_up() (bytes
    may be left unread: it closes the data plane where there is one and says whether it lives on) and
    still replies; a failure of the control connection itself is raised after that."""
    try:
        committed = land_runs()
    except Exception as exc:  # noqa: BLE001 - any failure: free, reply, keep serving
        status = exc.status if isinstance(exc, KVTransferError) else TransferStatus.INTERNAL
        inbox.put(incoming.fail(status, getattr(exc, "message", f"{type(exc).__name__}: {exc}")))
        send_status(conn, seq, status, give_up(), deadline)
        return
    except BaseException:
        inbox.put(incoming.fail(TransferStatus.INTERNAL, "interrupted"))
        raise
    finish_receive(conn, seq, incoming, inbox, committed, True, deadline)
