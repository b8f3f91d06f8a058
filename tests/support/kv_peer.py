"""A KV sender in a separate process, driven by typed commands over a multiprocessing pipe.

The pytest process hosts the receivers; a spawned peer hosts the senders. Besides
the public KVSender path, the peer can speak the wire protocol by hand to inject faults the real
sender never produces: a corrupted byte after checksumming, a stall mid-transfer, a truncated stream.
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass, field, replace

import grpc

from kv_transfer import (DistRendezvous, KVTransferError, ModelFingerprint, ReceiverAddress, SendRequest,
                         TransferConfig, create_sender)
from kv_transfer.control.connection import Kind
from kv_transfer.control.exchange import TransferFrame, await_status
from kv_transfer.dist.protocol import send_pieces, send_transfer
from kv_transfer.grpc.codec import PUSH_PATH, encode_checksum_chunk, encode_data_chunk, encode_manifest_chunk
from kv_transfer.manifest import encode_manifest
from kv_transfer.outgoing import OutgoingTransfer, prepare_outgoing
from kv_transfer.staging import StagingPool
from kv_transfer.status import TransferStatus
from kv_transfer.testing import FreeListPool, fill_blocks
from tests.support.child_processes import child_context
from tests.support.kv_hand_link import hand_link, inline_fault
from proto import tandem_pb2

FP32 = ModelFingerprint(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_size=4)
BF16 = ModelFingerprint(num_layers=3, num_kv_heads=1, head_dim=32, dtype="bfloat16", block_size=8)
SENDER_BLOCKS = 160


@dataclass(frozen=True)
class PeerSpec:
    """transport 'gloo' or 'grpc'; for gloo this peer's rank."""

    transport: str
    rank: int = 1
    world_size: int = 4
    timeout_s: float = 20.0
    inline_max_bytes: int | None = TransferConfig.inline_max_bytes  # gloo: 0 puts every transfer on the group


@dataclass(frozen=True)
class Start:
    """Fill `block_ids` of pool `dtype` with seeded values and send them to `to` (namespace for gloo),
    from a sender holding the cluster secret `secret` (None: none)."""

    key: str
    dtype: str
    to: ReceiverAddress
    block_ids: tuple[int, ...]
    num_tokens: int
    seed: int
    namespace: str = ""
    secret: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Cancel:
    key: str


@dataclass(frozen=True)
class Wait:
    key: str


@dataclass(frozen=True)
class Fault:
    """A hand-driven transfer: mode 'corrupt', 'stall' (sleep stall_s after the manifest), 'truncate'
    (grpc: drop the last chunk) or 'hang' (stall forever; the test kills the process). gRPC only, with the
    checksums trailing each run: 'bad-trailer' (the last run's checksum is off by one), 'no-trailer'
    (the last one is missing), 'early-data' (the first run's is missing, so run 1's bytes come early);
    and with the checksums in the manifest: 'stray-trailer' (a checksum chunk nobody expects)."""

    mode: str
    start: Start
    stall_s: float = 0.0
    rank: int = 2


@dataclass(frozen=True)
class FreeCounts:
    pass


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Outcome:
    ok: bool
    status: str = ""
    message: str = ""
    free: dict = field(default_factory=dict)


class _Peer:
    def __init__(self, spec: PeerSpec, conn):
        self.spec, self.conn = spec, conn
        self.pools = {"float32": FreeListPool(FP32, SENDER_BLOCKS), "bfloat16": FreeListPool(BF16, SENDER_BLOCKS)}
        self.config = TransferConfig(transport=spec.transport, kv_transfer_timeout_s=spec.timeout_s, connect_timeout_s=30,
                                     max_run_bytes=16 << 10,  # long runs split: exercises the pipeline
                                     inline_max_bytes=spec.inline_max_bytes)
        self.senders: dict[tuple[str, str], object] = {}
        self.handles: dict[str, object] = {}
        self.staging = StagingPool("cpu")

    def free_counts(self) -> dict:
        return {name: pool.num_free for name, pool in self.pools.items()}

    def sender(self, dtype: str, namespace: str, secret: str | None = None):
        if (dtype, namespace, secret) not in self.senders:
            rdzv = None
            if self.spec.transport != "grpc":
                rdzv = DistRendezvous(self.spec.rank, self.spec.world_size, namespace)
            config = replace(self.config, cluster_secret=secret)
            self.senders[(dtype, namespace, secret)] = create_sender(config, self.pools[dtype].view(),
                                                                     self.spec.transport, rdzv)
        return self.senders[(dtype, namespace, secret)]

    def prepare(self, cmd: Start) -> OutgoingTransfer:
        pool = self.pools[cmd.dtype]
        pool.take(cmd.block_ids)
        fill_blocks(pool.kv, cmd.block_ids, cmd.seed)
        outgoing = prepare_outgoing(pool.view(), SendRequest(cmd.key, cmd.block_ids, cmd.num_tokens, 1), self.staging)
        outgoing.gather_all()
        return outgoing

    def start(self, cmd: Start) -> Outcome:
        pool = self.pools[cmd.dtype]
        pool.take(cmd.block_ids)
        fill_blocks(pool.kv, cmd.block_ids, cmd.seed)
        request = SendRequest(cmd.key, cmd.block_ids, cmd.num_tokens, first_token=cmd.seed)
        self.handles[cmd.key] = self.sender(cmd.dtype, cmd.namespace, cmd.secret).send(cmd.to, request)
        return Outcome(True)

    def wait(self, key: str) -> Outcome:
        try:
            self.handles.pop(key).result(timeout=60)
            return Outcome(True, "OK", free=self.free_counts())
        except KVTransferError as exc:
            return Outcome(False, exc.status.name, exc.message, self.free_counts())

    def fault(self, cmd: Fault) -> Outcome:
        outgoing = self.prepare(cmd.start)
        try:
            if self.spec.transport == "grpc":
                return grpc_fault(cmd, outgoing, self.conn)
            return self.gloo_fault(cmd, outgoing)
        except KVTransferError as exc:
            return Outcome(False, exc.status.name, exc.message)
        finally:
            self.pools[cmd.start.dtype].free(cmd.start.block_ids)
            self.staging.release(outgoing.staging)

    def gloo_fault(self, cmd: Fault, outgoing: OutgoingTransfer) -> Outcome:
        """A hand-driven transfer on a control connection of its own (rank cmd.rank, lane 0)."""
        config = replace(self.config, cluster_secret=cmd.start.secret)
        deadline = time.monotonic() + 60
        inline = self.config.inline_max_bytes != 0
        with hand_link(cmd.start.to, config, cmd.start.namespace, cmd.rank, with_group=not inline) as (conn, channel):
            if inline:
                return self.inline_fault(cmd, outgoing, conn, deadline)
            if cmd.mode == "corrupt":
                outgoing.run_payloads[-1][-3] ^= 0x5A
                send_transfer(conn, channel, outgoing, 0, deadline, threading.Event())
                return Outcome(True, "OK")
            conn.send(Kind.TRANSFER, TransferFrame(0, outgoing.manifest_bytes, bytes(outgoing.direct)).encode(),
                      deadline)
            self.conn.send(Outcome(True, "STALLED"))
            time.sleep(cmd.stall_s if cmd.mode == "stall" else 3600)
            try:
                send_pieces(channel, outgoing, deadline)
            except KVTransferError:
                pass  # the receiver gave up and closed the group: its reply says why
            status, _ = await_status(conn, 0, deadline)
            return Outcome(status == TransferStatus.OK, status.name)

    def inline_fault(self, cmd: Fault, outgoing: OutgoingTransfer, conn, deadline: float) -> Outcome:
        """The same faults for a transfer whose bytes follow its frame on the control connection."""
        stall_s = cmd.stall_s if cmd.mode == "stall" else 3600.0
        ok, status, message = inline_fault(cmd.mode, stall_s, outgoing, conn, deadline,
                                           lambda: self.conn.send(Outcome(True, "STALLED")))
        return Outcome(ok, status, message)

    def serve(self) -> None:
        while True:
            cmd = self.conn.recv()
            if isinstance(cmd, Stop):
                break
            try:
                outcome = self.handle(cmd)
            except Exception:  # report harness bugs instead of leaving the test waiting
                outcome = Outcome(False, "HARNESS_ERROR", traceback.format_exc())
            self.conn.send(outcome)
        for sender in self.senders.values():
            sender.close()

    def handle(self, cmd) -> Outcome:
        if isinstance(cmd, Start):
            return self.start(cmd)
        if isinstance(cmd, Cancel):
            self.handles[cmd.key].cancel()
            return Outcome(True)
        if isinstance(cmd, Wait):
            return self.wait(cmd.key)
        if isinstance(cmd, Fault):
            return self.fault(cmd)
        if isinstance(cmd, FreeCounts):
            return Outcome(True, free=self.free_counts())
        raise TypeError(f"unknown command {cmd!r}")


TRAILER_FAULTS = ("bad-trailer", "no-trailer", "early-data")


def _grpc_fault_stream(mode: str, outgoing: OutgoingTransfer) -> tuple[bytes, list[bytes]]:
    """(manifest chunk, the chunks after it) of a hand-built gRPC transfer with the fault `mode`."""
    views = [memoryview(p.numpy()) for p in outgoing.run_payloads]
    if mode == "truncate":
        views[-1] = views[-1][: len(views[-1]) // 2]
    chunks = [encode_data_chunk(view) for view in views]
    if mode == "corrupt":
        last = bytearray(chunks[-1])
        last[-3] ^= 0x5A
        chunks[-1] = bytes(last)
    manifest = outgoing.manifest
    if mode == "stray-trailer":
        chunks.insert(1, encode_checksum_chunk(manifest.runs[0].checksum))
    if mode in TRAILER_FAULTS:
        trailers = [encode_checksum_chunk(run.checksum) for run in manifest.runs]
        if mode == "bad-trailer":
            trailers[-1] = encode_checksum_chunk((manifest.runs[-1].checksum + 1) % (1 << 64))
        chunks = [c for pair in zip(chunks, trailers) for c in pair]
        if mode != "bad-trailer":
            del chunks[1 if mode == "early-data" else -1]
        manifest = replace(manifest, runs=tuple(replace(run, checksum=None) for run in manifest.runs))
    return encode_manifest_chunk(encode_manifest(manifest)), chunks


def grpc_fault(cmd: Fault, outgoing: OutgoingTransfer, conn) -> Outcome:
    """Pushes a hand-built stream to the real gRPC receiver and reports its ack."""
    first, chunks = _grpc_fault_stream(cmd.mode, outgoing)

    def stream():
        yield first
        if cmd.mode in ("stall", "hang"):
            conn.send(Outcome(True, "STALLED"))
            time.sleep(cmd.stall_s if cmd.mode == "stall" else 3600)
        yield from chunks

    with grpc.insecure_channel(cmd.start.to.target) as channel:
        push = channel.stream_stream(PUSH_PATH, request_serializer=None, response_deserializer=tandem_pb2.KVAck.FromString)
        try:
            acks = list(push(stream(), timeout=60))
        except grpc.RpcError as exc:
            return Outcome(False, exc.code().name, exc.details() or "")
    final = acks[-1]
    return Outcome(final.status == tandem_pb2.KV_OK, tandem_pb2.KVStatus.Name(final.status), final.error)


def _peer_main(spec: PeerSpec, conn) -> None:
    _Peer(spec, conn).serve()


class PeerProcess:
    """Starts a peer (a child_context process) and sends it commands; call() returns the peer's Outcome."""

    def __init__(self, spec: PeerSpec):
        ctx = child_context()
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(spec, child), daemon=True)
        self.process.start()

    def call(self, cmd, timeout: float = 60) -> Outcome:
        self.conn.send(cmd)
        return self.reply(timeout)

    def reply(self, timeout: float = 60) -> Outcome:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer within {timeout}s")
        return self.conn.recv()

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, 9)
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(Stop())
            except OSError:
                pass
            self.process.join(30)
        self.kill()
