"""Inline transfers: a transfer's KV bytes ride the pair's authenticated control connection behind its TRANSFER frame
(the eager protocol of MPI and UCX), not the data plane's process group.

  sender                                          receiver
  TRANSFER {seq, manifest, inline_nbytes}          decode, check, allocate
  whole request: per run, right behind the frame,  read each run straight into its blocks (consecutive ids)
    its bytes, then its checksum (uint64 LE)         or staging, summing each piece as it comes in; check the
                                                     run's checksum, land it (scatter) as it completes
  layer-streamed: per layer, as the step writes    the same words as on a group (protocol.py), read in order
    it: NEXT_RUN, its bytes, its checksum; then
    COMMIT (or ABORT), the tail
                     <---------------------------  STATUS {seq, final status, whether the group lives}

A gloo sender takes this way for a transfer of at most TransferConfig.inline_max_bytes, by default for every
transfer: each byte is written once and read once, and no message goes through a process group, whose pair
protocol adds two notifications per message and, on a busy host, stalls of milliseconds, and whose listener
nothing authenticates. A pair that only ever carries inline transfers never opens a group (so no gloo listener
either). A whole request's checksums trail its runs: each side sums a piece (a plane, or a gathered run) right
before sending it or right after reading it, while it is in cache, and the first byte leaves without a pass over
the whole transfer first. While a streamed transfer writes its layers, a frame another thread sends on
the connection (a CANCEL) waits until the stream is written. The connection stays in step whatever the receiver
decides: a declined transfer's bytes are read and dropped before the reply (a manifest it cannot even decode
ends the connection instead); a read that fails half-way leaves the stream out of step, so the receiver closes
the connection (the sender connects afresh for its next transfer).
"""
from __future__ import annotations

from typing import Callable

import torch

from kv_transfer.checksum import RunChecksum
from kv_transfer.control.connection import ControlConnection, Kind
from kv_transfer.control.exchange import Declined, TransferFrame, answer_manifest, await_status, land_and_settle
from kv_transfer.dist.channel import PairChannel
from kv_transfer.dist.inline_batches import RUN_CHECKSUM, batch, byte_batches, inline_writes
from kv_transfer.dist.protocol import ABORT, COMMIT, NEXT_RUN, receive_runs, send_runs
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest import Manifest, ManifestError
from kv_transfer.manifest_decode import decode_manifest
from kv_transfer.outgoing import OutgoingTransfer
from kv_transfer.pool import KVPoolView
from kv_transfer.results import CancelFlag, ReceiveInbox
from kv_transfer.staging import StagingPool
from kv_transfer.status import KVTransferError, TransferStatus
from kv_transfer.stream_tail import MAX_TAIL_BYTES

HOST = torch.device("cpu")


def travels_inline(nbytes: int, backend: str, inline_max_bytes: int | None) -> bool:
    """Whether a transfer of nbytes of KV goes inline: over gloo, of at most inline_max_bytes (None: any)."""
    return backend == "gloo" and (inline_max_bytes is None or nbytes <= inline_max_bytes)


def inline_wire_nbytes(manifest: Manifest) -> int:
    """Bytes behind an inline TRANSFER frame: the KV, and for a whole request a checksum per run."""
    return manifest.total_nbytes + (0 if manifest.streamed else RUN_CHECKSUM.size * len(manifest.runs))


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy())  # a contiguous host tensor's bytes


class ConnectionWire:
    """The control connection as one inline transfer's data plane: the PairChannel calls protocol.py makes (tensors
    and int64 words, in order), each done at once on the connection's raw byte stream."""

    coalesces = False
    device = HOST

    def __init__(self, conn: ControlConnection, deadline: float):
        self.conn, self.deadline = conn, deadline

    def code_tensor(self, code: int) -> torch.Tensor:
        return torch.tensor([code], dtype=torch.int64)

    def send(self, tensor: torch.Tensor, deadline: float) -> None:
        self.conn.send_bytes([_bytes_of(tensor)], deadline)

    def send_code(self, code: int, deadline: float) -> None:
        self.send(self.code_tensor(code), deadline)

    def post_send(self, tensor: torch.Tensor) -> None:
        self.send(tensor, self.deadline)

    def post_sends(self, tensors: list[torch.Tensor]) -> list:
        self.conn.send_bytes([_bytes_of(t) for t in tensors], self.deadline)
        return []

    def recv(self, tensor: torch.Tensor, deadline: float) -> None:
        self.conn.read_into(_bytes_of(tensor), deadline)

    def recv_code(self, deadline: float) -> int:
        box = torch.empty(1, dtype=torch.int64)
        self.recv(box, deadline)
        return int(box.item())

    def post_recvs(self, tensors: list[torch.Tensor]) -> list:
        for tensor in tensors:
            self.recv(tensor, self.deadline)
        return []

    def wait(self, work: object, deadline: float, what: str) -> None:
        """Nothing to wait for: every call above completes before it returns."""


def send_inline(conn: ControlConnection, channel: PairChannel | None, outgoing: OutgoingTransfer, seq: int,
                deadline: float, cancel: CancelFlag, on_sent: Callable[[], None]) -> None:
    """Sender: the TRANSFER frame and the bytes behind it (a whole request's in one write; a streamed one's layer by
    layer, ABORT at the next layer once cancel is set), on_sent(), then the STATUS reply. Returns once the receiver
    landed everything (OK); raises Declined (the receiver said no, or the stream stopped) or KVTransferError (the
    connection failed). A receiver whose group is gone says so: this link's channel is then marked broken, so its
    next transfer on the group opens the next epoch."""
    stopped: KVTransferError | None = None
    whole = outgoing.stream is None
    if whole and not outgoing.manifest.trailing_checksums:
        raise ValueError("an inline transfer's manifest leaves its checksums to trail its runs")
    frame = TransferFrame(seq, outgoing.manifest_bytes, bytes(outgoing.direct) if whole else b"",
                          inline_nbytes=inline_wire_nbytes(outgoing.manifest))
    with conn.raw_stream(deadline):
        conn.send(Kind.TRANSFER, frame.encode(), deadline)  # alone: the receiver starts on it while we sum
        if whole:
            for views in inline_writes(outgoing):
                conn.send_bytes(views, deadline)
        else:
            stopped = send_runs(ConnectionWire(conn, deadline), outgoing, deadline, cancel)
    on_sent()
    final, alive = await_status(conn, seq, deadline)
    if not alive and channel is not None:
        channel.close()
        channel.mark_broken("the receiver closed this epoch's group")
    if stopped is not None:
        raise Declined(stopped.status, stopped.message, outgoing.manifest.request_id)
    if final != TransferStatus.OK:
        raise Declined(final, "receiver reported failure", outgoing.manifest.request_id)


class _InlineReader:
    """Reads one accepted inline transfer's bytes into its targets; knows whether the stream is still in step."""

    def __init__(self, conn: ControlConnection, incoming: IncomingTransfer, deadline: float):
        self.conn, self.incoming, self.deadline = conn, incoming, deadline
        self.in_step = False

    def read_all(self) -> bool:
        """A whole request: each run straight into this side's blocks where their ids are consecutive (else its
        staging piece), summed piece by piece as it comes in, then checked against its trailing checksum and
        landed. A run that fails its check fails the transfer once every byte is read (the stream stays in
        step). A streamed one: its layers and words. True: committed."""
        incoming = self.incoming
        if incoming.manifest.streamed:
            committed = receive_runs(ConnectionWire(self.conn, self.deadline), incoming, self.deadline)
            self.in_step = True
            return committed
        failed: KVTransferError | None = None
        fingerprint = incoming.manifest.fingerprint
        for index, run in enumerate(incoming.manifest.runs):
            targets, in_place = incoming.host_targets(index)  # its planes, in its blocks or staging
            summed = RunChecksum.of_run(fingerprint, run.num_blocks)
            trailer = bytearray(RUN_CHECKSUM.size)
            cuts = byte_batches(*targets[0].shape, fingerprint.row_nbytes)
            for number, cut in enumerate(cuts, 1):
                rows, views = batch(targets, cut)
                self.conn.read_into_all(views + [memoryview(trailer)] if number == len(cuts) else views, self.deadline)
                summed.add(rows)
            self.in_step = index == incoming.num_pieces - 1  # every byte read: a failure leaves the stream in step
            try:
                if failed is None:
                    incoming.landed(index, in_place=in_place, checksum=RUN_CHECKSUM.unpack(trailer)[0],
                                    inline=self.in_step, summed=summed.value())
            except KVTransferError as exc:  # read on: the rest of the transfer's bytes are on their way
                failed = exc
        if failed is not None:
            raise failed
        return True


def _skip_stream(conn: ControlConnection, manifest: Manifest, deadline: float) -> None:
    """Reads past a declined streamed transfer: its layers (or up to its ABORT), its COMMIT and tail."""
    wire, piece = ConnectionWire(conn, deadline), manifest.piece_nbytes[0]
    for _ in manifest.piece_nbytes:
        word = wire.recv_code(deadline)
        if word == ABORT:
            return
        if word != NEXT_RUN:
            raise KVTransferError(TransferStatus.MALFORMED, f"unexpected control word {word}")
        conn.skip(piece + 8, deadline)  # the layer and its checksum
    word = wire.recv_code(deadline)
    if word == COMMIT:
        length = wire.recv_code(deadline)
        if not 0 < length <= MAX_TAIL_BYTES:
            raise KVTransferError(TransferStatus.MALFORMED, f"tail length {length} out of range")
        conn.skip(length, deadline)
    elif word != ABORT:
        raise KVTransferError(TransferStatus.MALFORMED, f"unexpected control word {word}")


def receive_inline(conn: ControlConnection, channel: PairChannel | None, frame: TransferFrame, pool: KVPoolView,
                   staging: StagingPool, inbox: ReceiveInbox, deadline: float, lander,
                   inline_max_bytes: int | None) -> None:
    """The whole receiver side of an inline TRANSFER frame; the outcome goes to the inbox and the STATUS reply
    to the sender. Raises KVTransferError MALFORMED (nothing allocated; the caller ends the connection) for more
    inline bytes than this receiver would read: inline_max_bytes of KV, or (None) twice its whole pool (a transfer
    a little over the pool is declined from its manifest and read past, so its link stays in use; one announcing
    more costs the connection). ControlClosed / KVTransferError when the reply cannot go."""
    block_nbytes = pool.fingerprint.block_nbytes
    max_kv = inline_max_bytes
    if max_kv is None:
        max_kv = 2 * pool.manifest_limits.max_blocks * block_nbytes
    if frame.inline_nbytes > max_kv + RUN_CHECKSUM.size * (max_kv // block_nbytes):  # at most a run per block
        raise KVTransferError(TransferStatus.MALFORMED, f"an inline transfer of {frame.inline_nbytes} bytes "
                                                        f"(this receiver takes at most {max_kv} bytes of KV)")

    def group_alive() -> bool:
        return channel is not None and channel.broken is None

    streamed = not frame.direct  # a whole request's frame has a flag per run, a streamed one's none

    def accept(manifest: Manifest) -> IncomingTransfer:
        if inline_wire_nbytes(manifest) != frame.inline_nbytes or manifest.streamed != streamed \
                or manifest.total_nbytes > max_kv \
                or (not streamed and any(run.checksum is not None for run in manifest.runs)):
            raise KVTransferError(TransferStatus.MALFORMED, "the inline frame does not match its manifest",
                                  manifest.request_id)
        return IncomingTransfer.accept(manifest, pool, staging, lander, trailing_checksums=True, host_reads=True)

    def decline() -> bool:  # the bytes are on their way: read past them, so the connection stays in step
        if not streamed:
            conn.skip(frame.inline_nbytes, deadline)
            return group_alive()
        try:
            manifest = decode_manifest(frame.manifest, pool.manifest_limits)
        except ManifestError:  # where the stream ends is unknown: end the connection
            conn.close()
            return group_alive()
        _skip_stream(conn, manifest, deadline)
        return group_alive()

    incoming = answer_manifest(conn, frame, pool, inbox, deadline, accept, decline)
    if incoming is None:
        return
    reader = _InlineReader(conn, incoming, deadline)

    def give_up() -> bool:  # a read failed half-way: the stream is out of step
        if not reader.in_step:
            conn.close()
        return group_alive()

    land_and_settle(conn, frame.seq, incoming, inbox, deadline, reader.read_all, give_up)
