"""BlockAllocator: reference counts, prefix hits, LRU eviction of cached free blocks."""
from __future__ import annotations

import pytest

from engine.kv.block_allocator import BlockAllocator
from tests.support.old_hash_collision import colliding_first_blocks, old_chain_hash, tuple_hash


def fill(allocator: BlockAllocator, tokens: list[int]) -> list[int]:
    """Allocate blocks for tokens and register them as full cached blocks, like a finished prefill."""
    size = allocator.block_size
    blocks = allocator.allocate(len(tokens) // size)
    parent = None
    for i, block in enumerate(blocks):
        parent = allocator.register_full_block(block, parent, tokens[i * size:(i + 1) * size])
    return blocks


def test_allocate_and_free_with_ref_counts():
    allocator = BlockAllocator(4, 2)
    blocks = allocator.allocate(3)
    assert allocator.num_free_blocks == 1 and allocator.allocate(2) is None
    allocator.free(blocks)
    assert allocator.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        allocator.free(blocks[:1])


def test_prefix_hit_shares_blocks_until_both_free():
    allocator = BlockAllocator(8, 2)
    blocks = fill(allocator, [1, 2, 3, 4, 5, 6])
    hit, hashes = allocator.lookup_prefix([1, 2, 3, 4, 9, 9], max_blocks=3)
    assert hit == blocks[:2] and len(hashes) == 2
    assert allocator.ref_count(blocks[0]) == 2
    allocator.free(blocks)
    assert allocator.ref_count(blocks[0]) == 1 and allocator.num_free_blocks == 6
    allocator.free(hit)
    assert allocator.num_free_blocks == 8


def test_chained_hash_needs_the_whole_prefix():
    allocator = BlockAllocator(8, 2)
    allocator.free(fill(allocator, [1, 2, 3, 4]))
    assert allocator.lookup_prefix([9, 9, 3, 4], max_blocks=2) == ([], [])
    hit, _ = allocator.lookup_prefix([1, 2, 3, 4], max_blocks=1)
    assert len(hit) == 1, "max_blocks caps the hit"
    allocator.free(hit)


def test_free_cached_blocks_are_evicted_lru_tail_first():
    allocator = BlockAllocator(3, 1)
    old = fill(allocator, [1, 2, 3])
    allocator.free(old)                       # freed tail first: queue is 3, 2, 1
    assert allocator.num_cached_blocks == 3
    [taken] = allocator.allocate(1)           # evicts the tail block (token 3)
    assert taken == old[2] and allocator.num_cached_blocks == 2
    hit, _ = allocator.lookup_prefix([1, 2, 3], max_blocks=3)
    assert hit == old[:2]
    allocator.free(hit)
    allocator.free([taken])


def test_disabled_prefix_caching_never_hits():
    allocator = BlockAllocator(4, 2, enable_prefix_caching=False)
    allocator.free(fill(allocator, [1, 2, 3, 4]))
    assert allocator.lookup_prefix([1, 2, 3, 4], max_blocks=2) == ([], [])


def test_prefixes_built_to_collide_under_the_old_hash_share_no_block():
    """B0 + T is not served A0 + T's second block although the two collide under the old hash()."""
    a0, b0 = colliding_first_blocks(4)
    tail = [7, 7, 7, 7]
    assert tuple_hash((None, tuple(a0))) == hash((None, tuple(a0)))  # the model of CPython's hash holds
    a_hash, b_hash = old_chain_hash(None, a0), old_chain_hash(None, b0)
    assert b0 != a0 and a_hash != b_hash and old_chain_hash(a_hash, tail) == old_chain_hash(b_hash, tail)

    allocator = BlockAllocator(8, 4)
    a_blocks = fill(allocator, a0 + tail)      # one prompt's two blocks, cached
    b_first = fill(allocator, b0)              # another prompt's first block, cached
    hit, hashes = allocator.lookup_prefix(b0 + tail, max_blocks=2)
    assert hit == b_first and len(hashes) == 1  # B's own first block, never A's second
    assert allocator.lookup_prefix(a0 + tail, max_blocks=2)[0] == a_blocks  # A still hits both
    allocator.free(hit + a_blocks + a_blocks + b_first)
    assert allocator.num_free_blocks == 8
