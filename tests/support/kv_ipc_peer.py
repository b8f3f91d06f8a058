"""A KV sender over transport 'ipc' in a spawned process: kv_peer's peer, with its pools where a receiver can
map them (CPU pools in shared memory, or CUDA pools) and its hand-driven faults speaking the ipc message
order: 'corrupt' (a pool value changed after the manifest's checksums were taken), 'stall' / 'hang' (stop
half-way through the TRANSFER frame), 'bad-handle' (a pool handle naming a callable the receiver must
refuse to unpickle)."""
from __future__ import annotations

import os
import pickle
import struct
import time
from dataclasses import dataclass, replace

import msgpack

import torch

from kv_transfer.control.connection import Kind
from kv_transfer.control.exchange import TransferFrame, await_status
from kv_transfer.ipc.pool_handle import export_pool
from kv_transfer.status import TransferStatus
from kv_transfer.outgoing import OutgoingTransfer
from kv_transfer.testing import FreeListPool
from tests.support.child_processes import child_context
from tests.support.kv_hand_link import hand_link
from tests.support.kv_peer import BF16, FP32, SENDER_BLOCKS, Fault, Outcome, PeerProcess, PeerSpec, _Peer


@dataclass(frozen=True)
class IpcPeerSpec(PeerSpec):
    """transport 'ipc'; device: where the peer's pools live ('cpu': in shared memory, or 'cuda')."""

    device: str = "cpu"


def _mappable(pool: FreeListPool, device: str) -> FreeListPool:
    if device == "cpu":
        pool.kv.share_memory_()
        return pool
    fp = FP32 if pool.kv.dtype == torch.float32 else BF16
    return FreeListPool(fp, SENDER_BLOCKS, device=device)


class _IpcPeer(_Peer):
    def __init__(self, spec: IpcPeerSpec, conn):
        super().__init__(spec, conn)
        self.pools = {name: _mappable(pool, spec.device) for name, pool in self.pools.items()}

    def gloo_fault(self, cmd: Fault, outgoing: OutgoingTransfer) -> Outcome:
        """The ipc message order by hand on a connection of its own (rank cmd.rank); fault() has prepared
        the blocks and frees them. 'stall' / 'hang' send half of the TRANSFER frame, then stop."""
        config = replace(self.config, cluster_secret=cmd.start.secret)
        deadline = time.monotonic() + 60
        pool = self.pools[cmd.start.dtype]
        with hand_link(cmd.start.to, config, cmd.start.namespace, cmd.rank, with_group=False) as (conn, _):
            handle = pickle.dumps((os.getpid, ())) if cmd.mode == "bad-handle" else export_pool(pool.kv)
            if cmd.mode == "corrupt":
                pool.kv[-1, 1, cmd.start.block_ids[-1], -1, -1, -1] += 1  # after the manifest's checksums
                if pool.kv.is_cuda:
                    torch.cuda.synchronize()
            frame = TransferFrame(0, outgoing.manifest_bytes, b"", handle)
            if cmd.mode in ("stall", "hang"):
                body = msgpack.packb(frame.encode(), use_bin_type=True)
                conn.sock.sendall(struct.pack("!IB", len(body), Kind.TRANSFER) + body[: len(body) // 2])
                self.conn.send(Outcome(True, "STALLED"))
                time.sleep(cmd.stall_s if cmd.mode == "stall" else 3600)
                return Outcome(False, "STALLED")
            conn.send(Kind.TRANSFER, frame.encode(), deadline)
            status, _ = await_status(conn, 0, deadline)
            return Outcome(status == TransferStatus.OK, status.name)


def _ipc_peer_main(spec: IpcPeerSpec, conn) -> None:
    _IpcPeer(spec, conn).serve()


class IpcPeerProcess(PeerProcess):
    """Starts an ipc peer (same commands and replies as PeerProcess)."""

    def __init__(self, spec: IpcPeerSpec):
        ctx = child_context()  # children share this process's authkey (CPU handles need it)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_ipc_peer_main, args=(spec, child), daemon=True)
        self.process.start()
