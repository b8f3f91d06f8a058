"""The message order of one ipc transfer on the pair's control connection; no KV byte travels.

  sender                                       receiver
  TRANSFER {seq, manifest, [pool handle: the   [maps the sender's pool (or remembers why it cannot)]
            first time on this connection]} -> decode, cancel list, check against both pools, allocate,
                                                copy each run from the sender's pool into its own blocks,
                                                verify its checksum, wait for the copies to complete
                     <------------------------- STATUS {seq, final status}
  frees its blocks                              delivers (manifest, own block ids) or frees its blocks

The sender's KV is complete before its manifest leaves: prepare_outgoing takes the manifest's checksums
from the pool on a stream that waits for the ready event recorded at send(), and the host waits for them.
The mapping of the sender's pool lives as long as the connection; the sender sends its handle with every
TRANSFER until one was accepted on the connection.
"""
from __future__ import annotations

import time
from concurrent.futures import Executor

import torch

from kv_transfer.control.connection import ControlConnection, Kind
from kv_transfer.control.exchange import Declined, TransferFrame, answer_manifest, await_status, land_and_settle
from kv_transfer.ipc.landing import MappedIncoming
from kv_transfer.ipc.pool_handle import MAX_HANDLE_BYTES, PoolHandleError, import_pool
from kv_transfer.manifest import Manifest, ModelFingerprint
from kv_transfer.outgoing import OutgoingTransfer
from kv_transfer.pool import KVPoolView, fingerprint_of
from kv_transfer.results import ReceiveInbox
from kv_transfer.status import KVTransferError, TransferStatus

__all__ = ["PeerPool", "send_ipc", "receive_ipc"]


def send_ipc(conn: ControlConnection, outgoing: OutgoingTransfer, seq: int, pool_handle: bytes | None,
             deadline: float) -> None:
    """Sender: one TRANSFER frame (with the pool handle when the receiver has not mapped it yet), one STATUS
    back. Returns once the receiver acked OK (its copies are complete); raises Declined (the receiver said
    no) or KVTransferError (the connection failed)."""
    conn.send(Kind.TRANSFER, TransferFrame(seq, outgoing.manifest_bytes, b"", pool_handle).encode(), deadline)
    final, _ = await_status(conn, seq, deadline)
    if final != TransferStatus.OK:
        raise Declined(final, "receiver reported failure", outgoing.manifest.request_id)


class PeerPool:
    """Receiver: the sender's pool as mapped on one connection. `error` says why the last handle could not
    be mapped."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kv: torch.Tensor | None = None  # [L, 2, N_sender, bs, H, D], the sender's memory
        self.fingerprint: ModelFingerprint | None = None  # the mapped pool's layout
        self.error = "the sender's pool is not mapped"

    def load(self, handle: bytes) -> None:
        """Maps a freshly published handle, replacing any earlier mapping; remembers a refusal instead of
        raising (the manifest that follows is declined with it)."""
        self.kv = None
        try:
            self.kv, self.error = import_pool(handle, self.device), ""
            self.fingerprint = fingerprint_of(self.kv)
        except PoolHandleError as exc:
            self.error = str(exc)

    def check(self, manifest: Manifest) -> None:
        """Raises KVTransferError unless the manifest's runs are blocks of the mapped pool, in its layout."""
        rid = manifest.request_id
        if self.kv is None:
            raise KVTransferError(TransferStatus.MALFORMED, f"sender's pool handle refused: {self.error}", rid)
        diff = self.fingerprint.mismatch(manifest.fingerprint)
        if diff:
            raise KVTransferError(TransferStatus.MALFORMED, f"the manifest does not describe the sender's pool: {diff}",
                                  rid)
        if manifest.streamed:
            raise KVTransferError(TransferStatus.MALFORMED, "ipc copies whole runs: a streamed manifest", rid)
        sender_blocks = self.kv.shape[2]
        if any(run.start_block + run.num_blocks > sender_blocks for run in manifest.runs):
            raise KVTransferError(TransferStatus.MALFORMED, f"runs beyond the sender's {sender_blocks} blocks", rid)


def _copy_runs(incoming: MappedIncoming) -> bool:
    """Copies every run out of the sender's pool (on the lander; verified where the manifest has checksums).
    True: the sender's TRANSFER frame was its go-ahead."""
    incoming.landed_all()
    return True


def receive_ipc(conn: ControlConnection, frame: TransferFrame, peer: PeerPool, pool: KVPoolView,
                inbox: ReceiveInbox, timeout_s: float, lander: Executor) -> None:
    """The whole receiver side of one TRANSFER frame; the outcome goes to the inbox and the STATUS reply to
    the sender. Checked against this pool's limits, then against the sender's mapped pool, before anything
    is allocated. Raises ControlClosed / KVTransferError only when the reply cannot go."""
    deadline = time.monotonic() + timeout_s
    if frame.inline_nbytes:  # no KV byte travels on an ipc connection
        raise KVTransferError(TransferStatus.MALFORMED, "inline bytes on an ipc connection")
    if frame.pool_handle is not None:
        if len(frame.pool_handle) > MAX_HANDLE_BYTES:
            raise KVTransferError(TransferStatus.MALFORMED, "pool handle too long")
        peer.load(frame.pool_handle)

    def accept(manifest: Manifest) -> MappedIncoming:
        peer.check(manifest)
        verified = manifest.runs[0].checksum is not None  # run by run on the lander; else one copy, right here
        return MappedIncoming.accept_mapped(manifest, pool, lander if verified else None)

    incoming = answer_manifest(conn, frame, pool, inbox, deadline, accept, decline=lambda: True)
    if incoming is None:
        return
    incoming.source = peer.kv
    land_and_settle(conn, frame.seq, incoming, inbox, deadline, lambda: _copy_runs(incoming), give_up=lambda: True)
