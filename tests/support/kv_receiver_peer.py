"""A KV receiver in a spawned process whose pool stalls on its first allocation, so a test can kill the
receiving process while a transfer to it is under way and watch the sender."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from kv_transfer import DistRendezvous, KVPoolView, TransferConfig, create_receiver
from kv_transfer.testing import FreeListPool
from tests.support.child_processes import child_context
from tests.support.kv_peer import FP32

RECEIVER_RANK, SENDER_RANK = 0, 1
ALLOCATING = "allocating"


@dataclass(frozen=True)
class ReceiverSpec:
    transport: str  # 'gloo' or 'grpc'
    namespace: str = "receiver-death"


def rendezvous(spec: ReceiverSpec, rank: int) -> DistRendezvous | None:
    if spec.transport == "grpc":
        return None
    return DistRendezvous(rank, 2, spec.namespace)


def _main(spec: ReceiverSpec, conn) -> None:
    pool = FreeListPool(FP32, 64)

    def stall(num_blocks: int) -> list[int] | None:  # the transfer is under way: the manifest has arrived
        conn.send(ALLOCATING)
        time.sleep(3600)
        return None

    config = TransferConfig(transport=spec.transport, kv_transfer_timeout_s=120, connect_timeout_s=30)
    receiver = create_receiver(config, KVPoolView(pool.kv, stall, pool.free), spec.transport,
                               rendezvous=rendezvous(spec, RECEIVER_RANK), peers=[SENDER_RANK])
    conn.send(receiver.address)
    time.sleep(3600)


class ReceiverProcess:
    """Starts the stalling receiver; `address` is what a sender needs to reach it."""

    def __init__(self, spec: ReceiverSpec):
        ctx = child_context()
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(spec, child), daemon=True)
        self.process.start()
        if not self.conn.poll(60):
            raise TimeoutError("the receiver process did not start")
        self.address = self.conn.recv()

    def wait_allocating(self, timeout: float = 30) -> None:
        if not self.conn.poll(timeout) or self.conn.recv() != ALLOCATING:
            raise TimeoutError("no transfer reached the receiver")

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, 9)
        self.process.join(10)
