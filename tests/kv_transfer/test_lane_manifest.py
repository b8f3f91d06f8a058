"""A lane's manifest says which of the model's KV heads its blocks hold (Manifest.kv_heads, kv_transfer/lanes/): it
round-trips, a bad span is refused with a reason, and a pool takes only a transfer of exactly the heads it holds."""
from __future__ import annotations

import msgpack
import pytest

from kv_transfer import KVTransferError, ManifestError, ModelFingerprint, SendRequest, TransferStatus
from kv_transfer import decode_manifest, encode_manifest
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.outgoing import prepare_outgoing
from kv_transfer.pool import KVPoolView
from kv_transfer.staging import StagingPool
from kv_transfer.testing import FreeListPool

FP = ModelFingerprint(num_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16", block_size=4)


def lane_view(pool: FreeListPool, kv_heads: tuple[int, int] | None) -> KVPoolView:
    view = pool.view()
    return KVPoolView(view.kv, view.allocate, view.free, kv_heads=kv_heads)


def lane_manifest(kv_heads: tuple[int, int] | None):
    pool = FreeListPool(FP, 8)
    pool.take([2, 3])
    return prepare_outgoing(lane_view(pool, kv_heads), SendRequest("lane-1", (2, 3), 8, 7), StagingPool("cpu")).manifest


def test_the_heads_a_lane_holds_travel_in_its_manifest_and_only_then():
    lane = lane_manifest((3, 4))
    assert lane.kv_heads == (3, 4) and decode_manifest(encode_manifest(lane)) == lane
    whole = lane_manifest(None)
    assert whole.kv_heads is None and "kv_heads" not in msgpack.unpackb(encode_manifest(whole))


@pytest.mark.parametrize("raw, reason", [
    ([3], "kv_heads must be"), ([3, 5], "do not span the fingerprint's 1 KV heads"), ([-1, 0], r"kv_heads\[0\]"),
    (["3", 4], r"kv_heads\[0\] must be an int"), ("3:4", "kv_heads must be"),
])
def test_a_bad_head_span_is_refused_with_a_reason(raw, reason):
    data = msgpack.unpackb(encode_manifest(lane_manifest((3, 4))))
    data["kv_heads"] = raw
    with pytest.raises(ManifestError, match=reason):
        decode_manifest(msgpack.packb(data))


@pytest.mark.parametrize("sent, held", [((1, 2), (0, 1)), (None, (0, 1)), ((0, 1), None)])
def test_a_pool_takes_only_the_heads_it_holds_and_allocates_nothing_otherwise(sent, held):
    pool = FreeListPool(FP, 8)
    view = lane_view(pool, held)
    with pytest.raises(KVTransferError) as refused:
        IncomingTransfer.accept(lane_manifest(sent), view, StagingPool("cpu"))
    assert refused.value.status == TransferStatus.REJECTED_FINGERPRINT and "KV heads differ" in refused.value.message
    assert pool.num_free == 8


def test_a_pool_view_checks_its_head_span_against_its_tensor():
    with pytest.raises(ValueError, match="do not span the pool's 1 KV heads"):
        lane_view(FreeListPool(FP, 2), (0, 2))
