"""A KV sender over transport 'ipc' in a spawned process: kv_peer's peer, with its pools where a receiver can
map them (CPU pools in shared memory, or CUDA pools) and its hand-driven faults speaking the ipc message
order: 'corrupt' (a pool value changed after the manifest's checksums were taken), 'stall' / 'hang' (stop
after the accepted manifest, before COPY), 'bad-handle' (a pool handle naming a callable the receiver must
refuse to unpickle)."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import time
from dataclasses import dataclass

import torch

from kv_transfer.dist.channel import SENDER, PairChannel, connect_store, pair_prefix
from kv_transfer.ipc.pool_handle import export_pool
from kv_transfer.ipc.protocol import send_copy, send_manifest, send_pool_handle
from kv_transfer.outgoing import OutgoingTransfer
from kv_transfer.testing import FreeListPool
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
        """The ipc message order by hand on epoch 0 of the pair (cmd.rank -> receiver); fault() has
        prepared the blocks and frees them."""
        store = connect_store("127.0.0.1", self.spec.store_port)
        channel = PairChannel("gloo", store, pair_prefix(cmd.start.namespace, cmd.rank, cmd.start.to.rank),
                              SENDER, "cpu", 30)
        channel.ring(0)
        channel.connect()
        deadline = time.monotonic() + 60
        pool = self.pools[cmd.start.dtype]
        try:
            handle = pickle.dumps((os.getpid, ())) if cmd.mode == "bad-handle" else export_pool(pool.kv)
            send_pool_handle(channel, handle, deadline)
            if cmd.mode == "corrupt":
                pool.kv[-1, 1, cmd.start.block_ids[-1], -1, -1, -1] += 1  # after the manifest's checksums
                if pool.kv.is_cuda:
                    torch.cuda.synchronize()
            send_manifest(channel, outgoing, deadline)
            if cmd.mode in ("stall", "hang"):
                self.conn.send(Outcome(True, "STALLED"))
                time.sleep(cmd.stall_s if cmd.mode == "stall" else 3600)
            send_copy(channel, cmd.start.key, deadline, threading.Event())
            return Outcome(True, "OK")
        finally:
            channel.close()


def _ipc_peer_main(spec: IpcPeerSpec, conn) -> None:
    _IpcPeer(spec, conn).serve()


class IpcPeerProcess(PeerProcess):
    """Spawns an ipc peer (same commands and replies as PeerProcess)."""

    def __init__(self, spec: IpcPeerSpec):
        ctx = mp.get_context("spawn")  # spawned peers share this process's authkey (CPU handles need it)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_ipc_peer_main, args=(spec, child), daemon=True)
        self.process.start()
