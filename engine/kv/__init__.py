"""The paged KV cache: `KVCache`, the pool tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]` sized from a byte budget (`kv_cache.py`), and the `BlockAllocator` that owns its blocks
(reference counts, the prefix cache of chained block hashes, LRU eviction of free cached blocks). Every
path that ends a request frees exactly its blocks, once; kv_transfer ships runs of these blocks.
"""
