"""Builds the sender or receiver of a concrete transport by name."""
from __future__ import annotations

from typing import Sequence

from kv_transfer.config import DistRendezvous, TransferConfig
from kv_transfer.connector import KVReceiver, KVSender
from kv_transfer.pool import KVPoolView


def _concrete(transport: str) -> str:
    if transport == "auto":
        raise ValueError("resolve 'auto' with kv_transfer.resolve_transport() before building a transport")
    return transport


def _need_rendezvous(transport: str, rendezvous: DistRendezvous | None) -> DistRendezvous:
    if rendezvous is None:
        raise ValueError(f"transport {transport!r} needs a DistRendezvous")
    return rendezvous


def create_sender(config: TransferConfig, pool: KVPoolView, transport: str,
                  rendezvous: DistRendezvous | None = None) -> KVSender:
    """A KVSender for gloo / nccl / ipc (needs rendezvous) or grpc. ipc: ValueError unless the pool is on
    CUDA or a CPU pool in shared memory."""
    transport = _concrete(transport)
    if transport == "grpc":
        from kv_transfer.grpc.sender import GrpcSender
        return GrpcSender(config, pool)
    if transport == "ipc":
        from kv_transfer.ipc.transport import IpcSender
        return IpcSender(config, pool, _need_rendezvous(transport, rendezvous))
    from kv_transfer.dist.sender import TorchDistSender
    return TorchDistSender(config, pool, _need_rendezvous(transport, rendezvous), backend=transport)


def create_receiver(config: TransferConfig, pool: KVPoolView, transport: str,
                    rendezvous: DistRendezvous | None = None, peers: Sequence[int] = (),
                    host: str = "127.0.0.1", port: int = 0) -> KVReceiver:
    """A KVReceiver: gloo / nccl / ipc serve the sender ranks in peers on a control listener bound to host (a
    free port); grpc binds host:port (0 = free port). Its `address` is what senders need."""
    transport = _concrete(transport)
    if transport == "grpc":
        from kv_transfer.grpc.receiver import GrpcReceiver
        return GrpcReceiver(config, pool, host=host, port=port)
    if transport == "ipc":
        from kv_transfer.ipc.transport import IpcReceiver
        return IpcReceiver(config, pool, _need_rendezvous(transport, rendezvous), peers, host=host)
    from kv_transfer.dist.receiver import TorchDistReceiver
    return TorchDistReceiver(config, pool, _need_rendezvous(transport, rendezvous), peers, backend=transport, host=host)
