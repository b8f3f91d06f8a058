"""A hand-driven rank-transport link for fault tests: an authenticated control connection of its own and,
over it, epoch 0's gloo group, as a real SenderLink opens them. Tests then speak the protocol by hand
(kv_transfer.dist.protocol / kv_transfer.control.exchange) to produce what the real sender never does."""
from __future__ import annotations

import contextlib
import struct
import time
from dataclasses import replace
from typing import Callable, Iterator

from kv_transfer import ReceiverAddress, TransferConfig
from kv_transfer.control.connection import ControlConnection, Kind
from kv_transfer.control.exchange import TransferFrame, await_status
from kv_transfer.control.handshake import PeerHello
from kv_transfer.dist.channel import SENDER, PairChannel
from kv_transfer.dist.sender import open_control
from kv_transfer.manifest import encode_manifest
from kv_transfer.outgoing import OutgoingTransfer
from kv_transfer.status import KVTransferError, TransferStatus


@contextlib.contextmanager
def hand_link(to: ReceiverAddress, config: TransferConfig, namespace: str, rank: int,
              with_group: bool = True) -> Iterator[tuple[ControlConnection, PairChannel | None]]:
    """(connection, connected gloo channel or None) to the receiver at `to`, as sender `rank`, lane 0;
    both closed on exit."""
    conn = open_control(to, config, PeerHello(namespace, rank, 0))
    channel = PairChannel("gloo", SENDER, "cpu", config.connect_timeout_s) if with_group else None
    try:
        if channel is not None:
            conn.send(Kind.CONNECT, 0, time.monotonic() + config.connect_timeout_s)
            channel.connect(conn)
        yield conn, channel
    finally:
        if channel is not None:
            channel.close()
        conn.close()


def inline_wire(outgoing: OutgoingTransfer, seq: int, corrupt: bool = False) -> tuple[TransferFrame, bytes]:
    """A whole-request inline transfer as the real sender puts it on the wire (frame; each run's bytes, then its
    checksum), from an outgoing prepared with the checksums in its manifest and every run gathered. corrupt:
    a byte of the last run changed after its checksum was taken."""
    runs = outgoing.manifest.runs
    data = bytearray()
    for payload, run in zip(outgoing.run_payloads, runs):
        data += memoryview(payload.numpy())
        data += struct.pack("<Q", run.checksum)
    if corrupt:
        data[-8 - 3] ^= 0x5A
    manifest = replace(outgoing.manifest, runs=tuple(replace(run, checksum=None) for run in runs))
    return TransferFrame(seq, encode_manifest(manifest), bytes(outgoing.direct), inline_nbytes=len(data)), bytes(data)


def send_frame_with_bytes(conn: ControlConnection, frame: TransferFrame, data: bytes, deadline: float) -> None:
    """A TRANSFER frame and raw bytes right behind it, as the real inline sender writes them."""
    with conn.raw_stream(deadline):
        conn.send(Kind.TRANSFER, frame.encode(), deadline)
        conn.send_bytes([memoryview(data)], deadline)


def inline_fault(mode: str, stall_s: float, outgoing: OutgoingTransfer, conn: ControlConnection, deadline: float,
                 stalled: Callable[[], None]) -> tuple[bool, str, str]:
    """An inline transfer (bytes behind the frame on conn) with a fault: 'corrupt' (a byte changed after its
    checksum), else half its bytes, stalled(), stall_s seconds, the rest. (ok, final status, message)."""
    frame, data = inline_wire(outgoing, 0, corrupt=mode == "corrupt")
    if mode == "corrupt":
        send_frame_with_bytes(conn, frame, data, deadline)
        status, _ = await_status(conn, 0, deadline)
        return status == TransferStatus.OK, status.name, ""
    send_frame_with_bytes(conn, frame, data[: len(data) // 2], deadline)
    stalled()
    time.sleep(stall_s)
    try:
        conn.sock.sendall(memoryview(data)[len(data) // 2:])
        status, _ = await_status(conn, 0, deadline)
    except OSError:  # the receiver gave up and closed the connection
        return False, TransferStatus.PEER_FAILED.name, "connection closed"
    except KVTransferError as exc:
        return False, exc.status.name, exc.message
    return status == TransferStatus.OK, status.name, ""
