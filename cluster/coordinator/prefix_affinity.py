"""PrefixAffinity: which colocated replicas served which leading blocks of prompts.

A replica keeps the KV of the prompts it served in its prefix cache, so a prompt that starts with the same
blocks costs it only the rest. The coordinator remembers, for each prompt it routed, the chained hashes of
its first full blocks (1 up to `max_blocks` of them; never the block of the prompt's last token, which the
engine does not take from its cache) and, under each, the replicas that served a prompt starting that way,
in an LRU of `capacity` keys. A lookup returns the holders of the prompt's leading runs, longest run
first. Several replicas may hold one prefix: once a hot prefix spills over to a second replica (the router
bounds affinity by load), both hold it and share its traffic. A hash collision only misplaces a hint.
"""
from __future__ import annotations

from collections import OrderedDict


class PrefixAffinity:
    def __init__(self, block_size: int, max_blocks: int = 8, capacity: int = 65536) -> None:
        if block_size < 1 or max_blocks < 1 or capacity < 1:
            raise ValueError("block_size, max_blocks and capacity must be >= 1")
        self._block_size, self._max_blocks, self._capacity = block_size, max_blocks, capacity
        self._holders: OrderedDict[int, list[str]] = OrderedDict()  # chained block hash -> replicas, newest last

    def keys(self, prompt_token_ids: tuple[int, ...]) -> list[int]:
        """Chained hashes of the prompt's leading full blocks before its last token, shortest run first."""
        num_blocks = min(self._max_blocks, (len(prompt_token_ids) - 1) // self._block_size)
        keys, previous = [], 0
        for index in range(num_blocks):
            block = tuple(prompt_token_ids[index * self._block_size:(index + 1) * self._block_size])
            previous = hash((previous, block))
            keys.append(previous)
        return keys

    def holders(self, keys: list[int]) -> list[list[str]]:
        """For each key that has holders, longest run first: the replicas that served it."""
        return [list(self._holders[key]) for key in reversed(keys) if key in self._holders]

    def overlaps(self, keys: list[int]) -> dict[str, int]:
        """For each holder, the length in blocks of the longest of these leading runs it holds."""
        found: dict[str, int] = {}
        for length in range(len(keys), 0, -1):
            for holder in self._holders.get(keys[length - 1], ()):
                found.setdefault(holder, length)
        return found

    def remember(self, keys: list[int], replica: str) -> None:
        """`replica` served a prompt with these leading runs."""
        for key in keys:
            holders = self._holders.setdefault(key, [])
            if replica in holders:
                holders.remove(replica)
            holders.append(replica)
            self._holders.move_to_end(key)
        while len(self._holders) > self._capacity:
            self._holders.popitem(last=False)

    def forget(self, replica: str) -> None:
        """`replica` is gone: it holds nothing any more."""
        for key in list(self._holders):
            holders = self._holders[key]
            if replica in holders:
                holders.remove(replica)
                if not holders:
                    del self._holders[key]
