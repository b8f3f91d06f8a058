"""Forking a sequence: the samples of an n > 1 request share their prompt's KV.

Sample 0 prefills the prompt once. Right after that step, each other sample takes a block table that
references sample 0's full prompt blocks (one more reference each: a block is freed when the last sample
lets go of it) and a copy of the partial last block, into which each sample writes its own tokens. A
prompt that fills whole blocks shares every block and copies none. Without a free block for the copy,
the sample holds nothing and waits to recompute its prompt, through the prefix cache where the shared
blocks still are.
"""
from __future__ import annotations

from engine.core.scheduler import Scheduler
from engine.kv.block_allocator import BlockAllocator
from engine.kv.kv_cache import KVCache
from engine.sequence import Sequence


def fork_sequence(parent: Sequence, child: Sequence, allocator: BlockAllocator, kv_cache: KVCache) -> bool:
    """Give `child` (another sample of `parent`'s request, holding no block) parent's computed prompt: its
    full blocks shared, the partial last one copied; child's computed tokens and block hashes follow
    parent's. False, nothing changed, when no block is free for the copy."""
    num_full = parent.num_computed_tokens // allocator.block_size
    shared, partial = parent.block_table[:num_full], parent.block_table[num_full:]
    copies = allocator.allocate(len(partial)) if partial else []
    if copies is None:
        return False
    allocator.share(shared)
    if partial:
        kv_cache.copy_blocks(partial, copies)
    child.block_table = shared + copies
    child.num_computed_tokens = parent.num_computed_tokens
    child.num_cached_tokens = parent.num_cached_tokens
    child.block_hashes = list(parent.block_hashes)
    child.num_hashed_blocks = parent.num_hashed_blocks
    return True


def fork_samples(first: Sequence, scheduler: Scheduler, kv_cache: KVCache) -> None:
    """The other samples of `first`'s request share its just-prefilled prompt and start running (or, with
    no block free for a copy, wait at the head of the queue, in sample order, to recompute it)."""
    unforked = []
    for sample in first.forks:
        sample.prompt_logprobs = first.prompt_logprobs  # complete: computed once, for all samples
        if fork_sequence(first, sample, kv_cache.allocator, kv_cache):
            scheduler.add_running(sample)
        else:
            unforked.append(sample)
    for sample in reversed(unforked):
        scheduler.requeue(sample)
    first.forks = []
