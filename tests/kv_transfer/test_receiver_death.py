"""The receiving process dies mid-transfer: the sender fails the transfer as PEER_FAILED, long before its
timeout, and frees every block it was sending."""
from __future__ import annotations

import pytest

from kv_transfer import KVTransferError, SendRequest, TransferConfig, TransferStatus, create_sender
from kv_transfer.testing import FreeListPool, fill_blocks
from tests.support.kv_peer import FP32
from tests.support.kv_receiver_peer import SENDER_RANK, ReceiverProcess, ReceiverSpec, rendezvous

SENDER_BLOCKS = 32
TIMEOUT_S = 120.0  # far beyond the wait below: a failure in time is the peer's death, not a timeout


@pytest.mark.parametrize("transport", ["gloo", "grpc"])
def test_receiver_killed_mid_transfer(transport):
    spec = ReceiverSpec(transport)
    receiver = ReceiverProcess(spec)
    pool = FreeListPool(FP32, SENDER_BLOCKS)
    config = TransferConfig(transport=transport, kv_transfer_timeout_s=TIMEOUT_S, connect_timeout_s=30)
    sender = create_sender(config, pool.view(), transport, rendezvous=rendezvous(spec, SENDER_RANK))
    try:
        block_ids = tuple(range(4, 20))
        pool.take(block_ids)
        fill_blocks(pool.kv, block_ids, seed=3)
        handle = sender.send(receiver.address, SendRequest("doomed", block_ids, len(block_ids) * FP32.block_size, 7))
        receiver.wait_allocating()  # the manifest is in; the receiver is inside its pool's allocate
        receiver.kill()
        with pytest.raises(KVTransferError) as err:
            handle.result(timeout=30)
        assert err.value.status == TransferStatus.PEER_FAILED, err.value
        assert pool.num_free == SENDER_BLOCKS
    finally:
        receiver.kill()
        sender.close()
