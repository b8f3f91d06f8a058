"""KV transfer plane: ships a request's paged KV blocks from a prefill pool to a decode pool.

Public API (see docs/kv_transfer.md for the protocol):
    TransferConfig, DistRendezvous, ReceiverAddress      configuration and addressing
    KVPoolView                                            the engine's pool: kv tensor + allocate/free
    create_sender / create_receiver, resolve_transport    build a transport by name
    KVSender.send(peer, SendRequest) -> TransferHandle    ship blocks (the transfer frees them)
    KVReceiver.poll() / wait() / cancel() / close()       ReceivedKV (blocks now yours) | ReceiveFailed
"""
from kv_transfer.config import DistRendezvous, ReceiverAddress, TransferConfig
from kv_transfer.connector import KVReceiver, KVSender, resolve_transport
from kv_transfer.factory import create_receiver, create_sender
from kv_transfer.manifest import Manifest, ManifestError, ModelFingerprint, RunInfo, encode_manifest
from kv_transfer.manifest_decode import decode_manifest
from kv_transfer.pool import KVPoolView, fingerprint_of
from kv_transfer.results import ReceivedKV, ReceiveFailed, ReceiveOutcome, SendRequest, SendResult, TransferHandle
from kv_transfer.status import KVTransferError, TransferStatus

__all__ = [
    "DistRendezvous", "ReceiverAddress", "TransferConfig", "KVReceiver", "KVSender", "resolve_transport",
    "create_receiver", "create_sender", "Manifest", "ManifestError", "ModelFingerprint",
    "RunInfo", "decode_manifest", "encode_manifest", "KVPoolView", "fingerprint_of", "ReceivedKV",
    "ReceiveFailed", "ReceiveOutcome", "SendRequest", "SendResult", "TransferHandle", "KVTransferError",
    "TransferStatus",
]
