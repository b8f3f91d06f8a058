"""The message order of one ipc transfer over a PairChannel (gloo, CPU control tensors); no KV byte travels.

  sender                                       receiver
  ring doorbell seq  -------------------------> wakes (the first one also connects the pair)
  [pool not yet mapped on this channel:
   int64 length, uint8 pool handle ----------->  maps the sender's pool (or remembers why it cannot)]
  int64 manifest length, uint8 manifest ------> decode, cancel list, check against both pools, allocate
                     <------------------------- int64 accept code (OK: from now on the pool counts as
                                                mapped on this channel at both ends; else nothing follows)
  int64 COPY (or ABORT: cancelled) -----------> copy each run from the sender's pool into its own blocks,
                                                verify its checksum, wait for the copies to complete
                     <------------------------- int64 final status (OK / CHECKSUM_MISMATCH / CANCELLED / ...)
  frees its blocks                              delivers (manifest, own block ids) or frees its blocks

The sender's KV is complete before its manifest leaves: prepare_outgoing takes the manifest's checksums
from the pool on a stream that waits for the ready event recorded at send(), and the host waits for them.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Executor

import numpy as np
import torch

from kv_transfer.dist.channel import PairChannel
from kv_transfer.dist.protocol import (answer_manifest, land_and_settle,  # the shared answer, verdict and ack
                                       send_manifest)
from kv_transfer.ipc.landing import NO_STAGING, MappedIncoming
from kv_transfer.ipc.pool_handle import MAX_HANDLE_BYTES, PoolHandleError, import_pool
from kv_transfer.manifest import MAX_MANIFEST_BYTES, Manifest
from kv_transfer.pool import KVPoolView, fingerprint_of
from kv_transfer.results import ReceiveFailed, ReceiveInbox
from kv_transfer.status import KVTransferError, TransferStatus

COPY, ABORT = 1, 2

__all__ = ["COPY", "ABORT", "PeerPool", "send_pool_handle", "send_manifest", "send_copy", "receive_transfer"]


def _send_blob(channel: PairChannel, data: bytes, deadline: float) -> None:
    channel.send_code(len(data), deadline)
    channel.send(torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()), deadline)


def _recv_blob(channel: PairChannel, limit: int, deadline: float, what: str) -> bytes:
    length = channel.recv_code(deadline)
    if not 0 < length <= limit:  # the stream cannot be trusted past this point
        raise KVTransferError(TransferStatus.MALFORMED, f"{what} length {length} out of range")
    raw = torch.empty(length, dtype=torch.uint8)
    channel.recv(raw, deadline)
    return raw.numpy().tobytes()


def send_pool_handle(channel: PairChannel, handle: bytes, deadline: float) -> None:
    """Sender: publishes its pool (export_pool) before a manifest, while the channel has not mapped it."""
    _send_blob(channel, handle, deadline)


def send_copy(channel: PairChannel, request_id: str, deadline: float, cancel: threading.Event) -> None:
    """Sender, after an accepted manifest: lets the receiver copy (or aborts if cancel is set), then waits
    for its verdict. Returns once the receiver acked OK (its copies are complete); raises KVTransferError."""
    go = not cancel.is_set()
    channel.send_code(COPY if go else ABORT, deadline)
    final = TransferStatus(channel.recv_code(deadline))
    if not go:
        raise KVTransferError(TransferStatus.CANCELLED, "cancelled by the sender", request_id)
    if final != TransferStatus.OK:
        raise KVTransferError(final, "receiver reported failure", request_id)


class PeerPool:
    """Receiver: the sender's pool as mapped on one channel (epoch). `published` mirrors the sender's view:
    False until a manifest was accepted after the handle arrived, and while False the sender sends its
    handle again before the next manifest. `error` says why the last handle could not be mapped."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kv: torch.Tensor | None = None  # [L, 2, N_sender, bs, H, D], the sender's memory
        self.error = "the sender's pool is not mapped"
        self.published = False

    def load(self, handle: bytes) -> None:
        """Maps a freshly published handle, replacing any earlier mapping; remembers a refusal instead of
        raising (the manifest that follows is declined with it)."""
        self.kv = None
        try:
            self.kv, self.error = import_pool(handle, self.device), ""
        except PoolHandleError as exc:
            self.error = str(exc)

    def check(self, manifest: Manifest) -> None:
        """Raises KVTransferError unless the manifest's runs are blocks of the mapped pool, in its layout."""
        rid = manifest.request_id
        if self.kv is None:
            raise KVTransferError(TransferStatus.MALFORMED, f"sender's pool handle refused: {self.error}", rid)
        diff = fingerprint_of(self.kv).mismatch(manifest.fingerprint)
        if diff:
            raise KVTransferError(TransferStatus.MALFORMED, f"the manifest does not describe the sender's pool: {diff}",
                                  rid)
        if manifest.streamed:
            raise KVTransferError(TransferStatus.MALFORMED, "ipc copies whole runs: a streamed manifest", rid)
        sender_blocks = self.kv.shape[2]
        if any(run.start_block + run.num_blocks > sender_blocks for run in manifest.runs):
            raise KVTransferError(TransferStatus.MALFORMED, f"runs beyond the sender's {sender_blocks} blocks", rid)


def _receive_manifest(channel: PairChannel, peer: PeerPool, pool: KVPoolView, inbox: ReceiveInbox,
                      deadline: float, lander: Executor) -> MappedIncoming | None:
    """Reads the manifest and answers accept/decline; None when declined (nothing is held then). Checked
    against this pool's limits, then against the sender's mapped pool, before anything is allocated."""
    raw = _recv_blob(channel, MAX_MANIFEST_BYTES, deadline, "manifest")

    def accept(manifest):
        peer.check(manifest)
        return MappedIncoming.accept(manifest, pool, NO_STAGING, lander)

    incoming = answer_manifest(channel, raw, pool, inbox, deadline, accept)
    if incoming is not None:
        incoming.source = peer.kv
    return incoming


def _copy_runs(channel: PairChannel, incoming: MappedIncoming, deadline: float) -> bool:
    """Waits for COPY (True: every run is copied and verified on the lander) or ABORT (False)."""
    control = channel.recv_code(deadline)
    if control not in (COPY, ABORT):
        raise KVTransferError(TransferStatus.MALFORMED, f"unexpected control word {control}",
                              incoming.manifest.request_id)
    if control == COPY:
        for index in range(len(incoming.manifest.runs)):
            incoming.landed(index)
    return control == COPY


def receive_transfer(channel: PairChannel, peer: PeerPool, pool: KVPoolView, inbox: ReceiveInbox,
                     timeout_s: float, lander: Executor) -> None:
    """The whole receiver side of one announced transfer; the outcome goes to the inbox.
    Raises KVTransferError only when the link itself failed (after freeing whatever it held)."""
    deadline = time.monotonic() + timeout_s
    try:
        if not peer.published:
            peer.load(_recv_blob(channel, MAX_HANDLE_BYTES, deadline, "pool handle"))
        incoming = _receive_manifest(channel, peer, pool, inbox, deadline, lander)
    except KVTransferError as exc:  # the link failed before we learnt which request this was
        inbox.put(ReceiveFailed(exc.request_id, exc.status, exc.message))
        raise
    if incoming is None:
        return
    peer.published = True
    land_and_settle(channel, incoming, inbox, deadline, lambda: _copy_runs(channel, incoming, deadline))
