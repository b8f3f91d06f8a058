"""The manifest's prefix_blocks (decoder-side prefix reuse): the receiver holds the prompt's first k blocks, the
block list and runs cover the rest; validated in decode_manifest like every other field; a receiver allocates
only the rest; engine_pool's take_prefilled ships only the rest and frees the skipped blocks at once."""
from __future__ import annotations

import msgpack
import pytest

from engine import SamplingParams
from kv_transfer import ManifestError, ModelFingerprint, SendRequest, TransferStatus, decode_manifest, encode_manifest
from kv_transfer.engine_pool import take_prefilled
from kv_transfer.incoming import IncomingTransfer
from kv_transfer.manifest import ManifestLimits
from kv_transfer.outgoing import prepare_outgoing
from kv_transfer.staging import StagingPool
from kv_transfer.testing import FreeListPool, fill_blocks
from tests.support.engines import make_llm

FP = ModelFingerprint(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_size=4)
LIMITS = ManifestLimits(FP, max_blocks=16)


def skipping_manifest(prefix_blocks: int = 2):
    """22 tokens: 6 blocks of 4; the receiver holds the first prefix_blocks, the sender's blocks 7..."""
    pool = FreeListPool(FP, 16)
    blocks = tuple(range(7, 7 + 6 - prefix_blocks))
    pool.take(blocks)
    fill_blocks(pool.kv, blocks, seed=3)
    request = SendRequest("chat-2", blocks, 22, 5, prefix_blocks=prefix_blocks)
    return prepare_outgoing(pool.view(), request, StagingPool("cpu")).manifest


def test_prefix_blocks_round_trip_and_only_the_rest_travels():
    m = skipping_manifest(2)
    assert (m.prefix_blocks, m.num_blocks, m.total_nbytes) == (2, 4, 4 * FP.block_nbytes)
    raw = msgpack.unpackb(encode_manifest(m))
    assert raw["prefix_blocks"] == 2 and decode_manifest(encode_manifest(m), LIMITS) == m
    plain = skipping_manifest(0)
    assert "prefix_blocks" not in msgpack.unpackb(encode_manifest(plain)) and plain.num_blocks == 6
    raw_plain = msgpack.unpackb(encode_manifest(plain))
    raw_plain["prefix_blocks"] = 0                       # an explicit 0 means the same
    assert decode_manifest(msgpack.packb(raw_plain), LIMITS) == plain


@pytest.mark.parametrize("value, reason", [
    (-1, r"prefix_blocks=-1 outside \[0, 6\)"),
    (6, r"prefix_blocks=6 outside \[0, 6\)"),           # every block held: nothing would travel
    (2 ** 64 - 1, r"prefix_blocks=18446744073709551615 outside"),
    ("2", "prefix_blocks must be an int"),
    (True, "prefix_blocks must be an int"),
    (None, "prefix_blocks must be an int"),
    (3, r"need 3 blocks \(3 held by the receiver\), manifest lists 4"),   # runs list 4 blocks: inconsistent
    (1, r"need 5 blocks \(1 held by the receiver\), manifest lists 4"),
])
def test_a_bad_prefix_blocks_is_refused_naming_the_field(value, reason):
    raw = msgpack.unpackb(encode_manifest(skipping_manifest(2)))
    raw["prefix_blocks"] = value
    for limits in (None, LIMITS):
        with pytest.raises(ManifestError, match=reason):
            decode_manifest(msgpack.packb(raw), limits)


def test_a_receiver_allocates_only_the_blocks_that_travel():
    pool = FreeListPool(FP, 16)
    incoming = IncomingTransfer.accept(skipping_manifest(4), pool.view(), StagingPool("cpu"))
    assert len(incoming.block_ids) == 2 and pool.num_free == 14
    incoming.fail(TransferStatus.CANCELLED, "cancelled")
    assert pool.num_free == 16


def test_take_prefilled_ships_the_rest_and_frees_the_skipped_blocks_into_the_prefix_cache():
    engine = make_llm("tiny", num_kv_blocks=32, block_size=16).engine
    prompt = list(range(3, 53))                            # 50 tokens: 4 blocks, at most 3 skipped
    engine.add_request("p", prompt, SamplingParams(max_tokens=4, temperature=0.0), prefill_only=True)
    while engine.get_sequence("p").status.value != "prefilled":
        engine.step()
    blocks = list(engine.get_sequence("p").block_table)
    with pytest.raises(ValueError, match=r"prefix_blocks must be in \[0, 4\)"):
        take_prefilled(engine, "p", prefix_blocks=4)
    request = take_prefilled(engine, "p", prefix_blocks=3)
    assert (request.block_ids, request.num_tokens, request.prefix_blocks) == (tuple(blocks[3:]), 50, 3)
    assert all(engine.kv_cache.allocator.ref_count(b) == 0 for b in blocks[:3])   # back in the pool, cached
    assert engine.pin_cached_prefix(prompt) == blocks[:3]                          # and still findable
    engine.free_blocks(blocks[:3] + list(request.block_ids))
    assert engine.num_free_blocks == engine.num_total_blocks
