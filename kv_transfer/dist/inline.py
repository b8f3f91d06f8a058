"""Inline transfers: a small transfer's KV bytes ride the pair's control connection right behind its TRANSFER
frame (the eager protocol of MPI and UCX), not the data plane's process group.

  sender                                          receiver
  TRANSFER {seq, manifest, inline_nbytes}          decode, check, allocate; read the bytes straight into its
    + inline_nbytes raw bytes (every run) ------>  blocks (consecutive ids) or staging, landing each run
                                                   (checksum, scatter) as it completes
                     <---------------------------  STATUS {seq, final status, whether the group lives}

A gloo sender takes this way for a whole-request transfer of at most TransferConfig.inline_max_bytes: each byte
is written once and read once, and no message goes through the process group, whose pair protocol adds two
notifications per message and, on a busy host, stalls of milliseconds. A pair that only ever carries inline
transfers never opens a group at all (so no gloo listener either). The connection stays in step whatever the
receiver decides: a declined transfer's bytes are read and dropped; a read that fails half-way leaves the
stream out of step, so the receiver closes the connection (the sender connects afresh for its next transfer).
"""
from __future__ import annotations

import torch

from kv_transfer.control.connection import ControlConnection, Kind
from kv_transfer.control.exchange import Declined, TransferFrame, answer_manifest, await_status, land_and_settle
from kv_transfer.dist.channel import PairChannel
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest import Manifest
from kv_transfer.outgoing import OutgoingTransfer
from kv_transfer.pool import KVPoolView
from kv_transfer.results import ReceiveInbox
from kv_transfer.staging import StagingPool
from kv_transfer.status import KVTransferError, TransferStatus

HOST = torch.device("cpu")


def travels_inline(outgoing: OutgoingTransfer, backend: str, inline_max_bytes: int) -> bool:
    """Whether a transfer goes inline: a whole request (not layer-streamed) over gloo, small enough."""
    return backend == "gloo" and outgoing.stream is None and outgoing.manifest.total_nbytes <= inline_max_bytes


def send_inline(conn: ControlConnection, channel: PairChannel | None, outgoing: OutgoingTransfer, seq: int,
                deadline: float) -> None:
    """Sender: the TRANSFER frame with every run's bytes behind it (gathered where a run is not direct), then the
    STATUS reply. Returns once the receiver landed everything (OK); raises Declined (the receiver said no) or
    KVTransferError (the connection failed). A receiver whose group is gone says so: this link's channel is
    then marked broken, so its next data-plane transfer opens the next epoch."""
    views = []
    for index in range(outgoing.num_pieces):
        outgoing.gather(index)
        views += [memoryview(piece.numpy()) for piece in outgoing.pieces(index)]  # flat uint8, wire order
    frame = TransferFrame(seq, outgoing.manifest_bytes, bytes(outgoing.direct), inline_nbytes=sum(map(len, views)))
    conn.send_with_bytes(Kind.TRANSFER, frame.encode(), views, deadline)
    final, alive = await_status(conn, seq, deadline)
    if not alive and channel is not None:
        channel.close()
        channel.mark_broken("the receiver closed this epoch's group")
    if final != TransferStatus.OK:
        raise Declined(final, "receiver reported failure", outgoing.manifest.request_id)


class _InlineReader:
    """Reads one accepted inline transfer's bytes into its targets; knows whether the stream is still in step."""

    def __init__(self, conn: ControlConnection, incoming: IncomingTransfer, deadline: float):
        self.conn, self.incoming, self.deadline = conn, incoming, deadline
        self.remaining = incoming.manifest.total_nbytes

    def read_all(self) -> bool:
        """Each run straight into this side's blocks where their ids are consecutive (else its staging piece),
        landed as soon as it is in. True: the frame was the sender's commit."""
        incoming, last = self.incoming, self.incoming.num_pieces - 1
        for index in range(incoming.num_pieces):
            targets, in_place = incoming.plane_targets(index, HOST)
            for target in targets:  # flat uint8 views
                self.conn.read_into(memoryview(target.numpy()), self.deadline)
                self.remaining -= target.numel()
            incoming.landed(index, in_place=in_place, inline=index == last)
        return True


def receive_inline(conn: ControlConnection, channel: PairChannel | None, frame: TransferFrame, pool: KVPoolView,
                   staging: StagingPool, inbox: ReceiveInbox, deadline: float, lander, inline_max_bytes: int) -> None:
    """The whole receiver side of an inline TRANSFER frame; the outcome goes to the inbox and the STATUS reply
    to the sender. Raises KVTransferError MALFORMED (nothing allocated; the caller ends the connection) for more
    inline bytes than this receiver takes, and ControlClosed / KVTransferError when the reply cannot go."""
    if frame.inline_nbytes > inline_max_bytes:
        raise KVTransferError(TransferStatus.MALFORMED, f"an inline transfer of {frame.inline_nbytes} bytes "
                                                        f"(this receiver takes at most {inline_max_bytes})")

    def group_alive() -> bool:
        return channel is not None and channel.broken is None

    def accept(manifest: Manifest) -> IncomingTransfer:
        if manifest.streamed or manifest.total_nbytes != frame.inline_nbytes:
            raise KVTransferError(TransferStatus.MALFORMED, f"{frame.inline_nbytes} inline bytes for a manifest "
                                                            f"of {manifest.total_nbytes}", manifest.request_id)
        return IncomingTransfer.accept(manifest, pool, staging, lander)

    def decline() -> bool:  # the bytes are on their way: read past them, the connection stays in step
        conn.skip(frame.inline_nbytes, deadline)
        return group_alive()

    incoming = answer_manifest(conn, frame, pool, inbox, deadline, accept, decline)
    if incoming is None:
        return
    reader = _InlineReader(conn, incoming, deadline)

    def give_up() -> bool:  # a read failed half-way: the stream is out of step
        if reader.remaining:
            conn.close()
        return group_alive()

    land_and_settle(conn, frame.seq, incoming, inbox, deadline, reader.read_all, give_up)
