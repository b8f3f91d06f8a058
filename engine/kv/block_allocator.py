"""BlockAllocator: reference-counted KV blocks with a prefix cache and LRU eviction.

A block is free when its reference count is 0. Free blocks sit in an LRU queue; a free block that
still holds a full, hashed block of tokens stays findable by its hash until the allocator hands it
out again (evicting the hash). Hashes are chained: sha256(parent digest, tokens of this block), so a hit
on block i means blocks 0..i all match. The digest is collision-resistant on purpose: with a
non-cryptographic hash (Python's `hash()` of a tuple), two different prefixes can be built to share a
chained hash, and one request would then attend to another's KV (the class of vLLM's CVE-2025-25183).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

NO_HASH = None


BlockHash = bytes  # a sha256 digest


def chain_hash(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Digest of a full block, chained to the digest of the block before it (None for the first).

    sha256 over the parent's digest (32 bytes, or none for the first block) and the block's token ids as
    decimal text with separators: unambiguous for any int, the same in every process and run."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.digest()


class BlockAllocator:
    """Owns the ids 0..num_blocks-1 of one KV pool.

    Thread-safe: the engine's step loop and KV-transfer threads (which reserve blocks for incoming KV
    and free blocks after a send is acknowledged) may call it concurrently.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [NO_HASH] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._lock = threading.Lock()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take num_blocks free blocks (ref count 1 each), evicting their cached hashes; None if short."""
        with self._lock:
            if num_blocks > len(self._free):
                return None
            block_ids = []
            for _ in range(num_blocks):
                block_id, _ = self._free.popitem(last=False)
                self._evict_hash(block_id)
                self._ref_counts[block_id] = 1
                block_ids.append(block_id)
            return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the LRU queue, last first.

        Freeing in reverse order makes a sequence's tail blocks the first to be evicted, so shared
        prefixes stay cached longest.
        """
        with self._lock:
            for block_id in block_ids:
                if self._ref_counts[block_id] <= 0:
                    raise RuntimeError(f"block {block_id} freed more often than it was allocated")
            for block_id in reversed(block_ids):
                count = self._ref_counts[block_id]
                self._ref_counts[block_id] = count - 1
                if count == 1:
                    self._free[block_id] = None

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each of these blocks, all in use (a forked sequence shares them)."""
        with self._lock:
            for block_id in block_ids:
                if self._ref_counts[block_id] <= 0:
                    raise RuntimeError(f"block {block_id} is free: it cannot be shared")
            for block_id in block_ids:
                self._ref_counts[block_id] += 1

    def lookup_prefix(self, token_ids: Sequence[int], max_blocks: int) -> tuple[list[int], list[BlockHash]]:
        """Longest run of cached full blocks that prefixes token_ids, at most max_blocks of them.

        Takes a reference on every block it returns. Returns (block_ids, their chained hashes).
        """
        if not self.enable_prefix_caching:
            return [], []
        block_ids, hashes, parent = [], [], None
        with self._lock:
            for i in range(max_blocks):
                tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
                block_hash = chain_hash(parent, tokens)
                block_id = self._hash_to_block.get(block_hash)
                if block_id is None or self._block_tokens[block_id] != tokens:
                    break
                block_ids.append(block_id)
                hashes.append(block_hash)
                parent = block_hash
            for block_id in block_ids:
                self._take_reference(block_id)
        return block_ids, hashes

    def register_full_block(self, block_id: int, parent_hash: BlockHash | None,
                            token_ids: Sequence[int]) -> BlockHash:
        """Record that block_id now holds these block_size tokens; returns the block's chained hash.

        If another block already holds the same prefix, the first one stays the cached copy.
        """
        tokens = tuple(token_ids)
        block_hash = chain_hash(parent_hash, tokens)
        with self._lock:
            if self.enable_prefix_caching and block_hash not in self._hash_to_block \
                    and self._block_hash[block_id] is NO_HASH:
                self._hash_to_block[block_hash] = block_id
                self._block_hash[block_id] = block_hash
                self._block_tokens[block_id] = tokens
        return block_hash

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated)."""
        with self._lock:
            for block_id in list(self._hash_to_block.values()):
                self._evict_hash(block_id)

    def _take_reference(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def _evict_hash(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not NO_HASH:
            del self._hash_to_block[block_hash]
            self._block_hash[block_id] = NO_HASH
            self._block_tokens[block_id] = None
