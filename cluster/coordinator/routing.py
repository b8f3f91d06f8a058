"""Where a request goes: the coordinator's view of its workers' load, and the routing policies.

Decode first: the alive decode worker with the most free KV blocks, then the fewest running requests; with
decoder-side prefix reuse (kv_overlap_weight set), the blocks of the prompt a worker is known to hold are
scored against its free blocks (KV-aware routing, cluster/coordinator/kv_routing.py).
Prefill then: the alive prefill worker with the shortest queue (prompt tokens dispatched and not yet
reported), except that prompts sharing their first block of tokens go to the same prefill worker (its
prefix cache holds that block) unless that worker's queue is longer than the shortest by more than
`affinity_slack_tokens`.

Colocated replicas (no prefill workers; each replica prefills its own prompts): the alive replica with the
least load, counted in tokens the next steps must run: its running requests (one token each per step)
plus the prompt tokens routed to it that have not produced their first token yet (waiting tokens); then
the most free blocks; replicas whose free blocks cannot hold the request go last. Prefix affinity
(cluster/coordinator/prefix_affinity.py) goes first: a prompt whose leading blocks a replica served goes
back to it (the longest such run wins), while that replica's waiting tokens are within
`affinity_slack_tokens` of the least waiting replica's and its running requests within
`affinity_slack_requests` of the fewest, so one hot prefix cannot pile onto one replica: past the slack it
spills to the least loaded replica, which then holds the prefix too.

The load is the coordinator's own accounting (it is the only client of its workers): a decode worker's
free blocks are its pool minus an estimate of what the requests routed there may hold (prompt + max
tokens); the workers themselves refuse what they cannot take (backpressure), and the coordinator then
tries the next one. Used from one asyncio loop: no locks.
"""
from __future__ import annotations

from collections import OrderedDict

from cluster.coordinator.kv_routing import DecodePrefixIndex, kv_aware_order
from cluster.coordinator.prefix_affinity import PrefixAffinity
from cluster.coordinator.worker_loads import DecodeLoad, PrefillLoad


class Router:
    """Load accounting and the two policies (see the module docstring)."""

    def __init__(self, prefill_names: list[str], decode_blocks: dict[str, int], block_size: int,
                 affinity_slack_tokens: int = 4096, affinity_capacity: int = 65536,
                 affinity_slack_requests: int = 16, kv_overlap_weight: float | None = None) -> None:
        """kv_overlap_weight: KV-aware decode routing with this weight (None: by load only)."""
        self._prefill = {name: PrefillLoad(name) for name in prefill_names}
        self._decode = {name: DecodeLoad(name, total) for name, total in decode_blocks.items()}
        self._block_size = block_size
        self._slack, self._capacity = affinity_slack_tokens, affinity_capacity
        self._affinity: OrderedDict[int, str] = OrderedDict()  # hash of a first block -> prefill worker
        self._slack_requests = affinity_slack_requests
        self._prefixes = PrefixAffinity(block_size, capacity=affinity_capacity)  # replicas' leading blocks
        self._kv_weight = kv_overlap_weight
        self._decode_prefixes = DecodePrefixIndex(block_size)  # what decode workers hold (KV-aware routing)

    def decode_order(self, prompt_token_ids: tuple[int, ...] = (), blocks: int = 0) -> list[str]:
        """Alive decode workers, best first: most free blocks, then fewest running, then name; with
        KV-aware routing, the blocks of the prompt each is known to hold count against its load."""
        alive = [load for load in self._decode.values() if load.alive]
        overlaps = {} if self._kv_weight is None else self._decode_prefixes.overlaps(prompt_token_ids)
        weight = self._kv_weight or 0.0
        return kv_aware_order(alive, overlaps, self.decode_blocks_for(len(prompt_token_ids)), blocks, weight)

    def decode_holds(self, token_ids: tuple[int, ...], decode: str) -> None:
        """Decode worker `decode` holds the KV of token_ids in its prefix cache (KV-aware routing only)."""
        if self._kv_weight is not None and self._decode[decode].alive:
            self._decode_prefixes.holds(token_ids, decode)

    def replica_order(self, prompt_token_ids: tuple[int, ...], blocks: int) -> list[str]:
        """Alive replicas, best first (see the module docstring); `blocks`: what the request may hold."""
        alive = [load for load in self._decode.values() if load.alive]
        ranked = sorted(alive, key=lambda d: (d.free_blocks < blocks, d.running + d.queued_tokens,
                                              -d.free_blocks, d.name))
        preferred = self._affine_replica(prompt_token_ids, alive, blocks)
        if preferred is not None:
            ranked.remove(preferred)
            ranked.insert(0, preferred)
        return [load.name for load in ranked]

    def _affine_replica(self, prompt_token_ids: tuple[int, ...], alive: list[DecodeLoad],
                        blocks: int) -> DecodeLoad | None:
        """The replica holding the prompt's longest leading run, within the slack of the least loaded."""
        if not alive:
            return None
        queued, running = min(d.queued_tokens for d in alive), min(d.running for d in alive)
        for holders in self._prefixes.holders(self._prefixes.keys(prompt_token_ids)):
            fits = [load for load in (self._decode[name] for name in holders)
                    if load.alive and load.free_blocks >= blocks and load.queued_tokens <= queued + self._slack
                    and load.running <= running + self._slack_requests]
            if fits:
                return min(fits, key=lambda d: (d.running + d.queued_tokens, d.name))
        return None

    def served_prefix(self, prompt_token_ids: tuple[int, ...], replica: str) -> None:
        """`replica` is given this prompt: its prefix cache will hold the prompt's leading blocks."""
        self._prefixes.remember(self._prefixes.keys(prompt_token_ids), replica)

    def pick_prefill(self, prompt_token_ids: tuple[int, ...]) -> str | None:
        """The prefill worker for this prompt (None if none is alive); remembers the prefix's worker."""
        alive = [load for load in self._prefill.values() if load.alive]
        if not alive:
            return None
        shortest = min(alive, key=lambda p: (p.queued_tokens, p.name))
        if len(prompt_token_ids) <= self._block_size:  # no full block before the last token: nothing to share
            return shortest.name
        key = hash(tuple(prompt_token_ids[:self._block_size]))  # a collision only misplaces a hint
        preferred = self._prefill.get(self._affinity.get(key, ""))
        if preferred is not None and preferred.alive \
                and preferred.queued_tokens <= shortest.queued_tokens + self._slack:
            self._affinity.move_to_end(key)
            return preferred.name
        self._affinity[key] = shortest.name
        self._affinity.move_to_end(key)
        while len(self._affinity) > self._capacity:
            self._affinity.popitem(last=False)
        return shortest.name

    def prefill_queue_tokens(self) -> int:
        """The prompt tokens queued on the least loaded alive prefill worker (0 if none is alive)."""
        return min((load.queued_tokens for load in self._prefill.values() if load.alive), default=0)

    def prefill_refusal(self, prompt_tokens: int, max_queue_tokens: int) -> str | None:
        """Why a prompt of `prompt_tokens` must be refused for now (429), or None: every alive prefill
        worker's queue would pass max_queue_tokens with it (0: no bound). A prompt longer than the bound
        is refused only while the queues hold anything, so that it is not refused forever."""
        queues = [load.queued_tokens for load in self._prefill.values() if load.alive]
        if not max_queue_tokens or not queues or min(queues) == 0 or min(queues) + prompt_tokens <= max_queue_tokens:
            return None
        return (f"the prefill queues hold at least {min(queues)} tokens each; with this prompt's {prompt_tokens} "
                f"that passes the limit of {max_queue_tokens}")

    def decode_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def claim_decode(self, decode: str, blocks: int, queued_tokens: int = 0) -> None:
        """A request goes to `decode` (claimed before its admission is known, so that concurrent requests
        see it); decode_done undoes it. queued_tokens: the prompt tokens it prefills there itself, waiting
        until prefilled() (local prefill)."""
        self._decode[decode].claimed_blocks += blocks
        self._decode[decode].running += 1
        self._decode[decode].queued_tokens += queued_tokens

    def prefilled(self, decode: str, queued_tokens: int) -> None:
        """The request's first token came (or it ended first): its prompt no longer waits on `decode`."""
        self._decode[decode].queued_tokens -= queued_tokens

    def decode_done(self, decode: str, blocks: int) -> None:
        self._decode[decode].claimed_blocks -= blocks
        self._decode[decode].running -= 1

    def claim_prefill(self, prefill: str, prompt_tokens: int) -> None:
        self._prefill[prefill].queued_tokens += prompt_tokens

    def prefill_done(self, prefill: str, prompt_tokens: int) -> None:
        """The prefill worker reported (or the request ended before it did): its queue shrinks."""
        self._prefill[prefill].queued_tokens -= prompt_tokens

    def mark_dead(self, name: str) -> bool:
        """Stop routing to `name`; True if it was alive."""
        load = self._prefill.get(name) or self._decode.get(name)
        if load is None or not load.alive:
            return False
        load.alive = False
        for key in [k for k, worker in self._affinity.items() if worker == name]:
            del self._affinity[key]
        self._prefixes.forget(name)
        self._decode_prefixes.forget(name)
        return True

    def is_alive(self, name: str) -> bool:
        load = self._prefill.get(name) or self._decode.get(name)
        return load is not None and load.alive

    def alive_counts(self) -> tuple[int, int]:
        """(alive prefill workers, alive decode workers)."""
        return (sum(p.alive for p in self._prefill.values()), sum(d.alive for d in self._decode.values()))

    def add_prefill(self, name: str) -> None:
        """A prefill worker joined (added while serving): routed to from now on."""
        self._prefill[name] = PrefillLoad(name)

    def add_decode(self, name: str, total_blocks: int) -> None:
        """A decode worker (replica) of `total_blocks` joined: routed to from now on."""
        self._decode[name] = DecodeLoad(name, total_blocks)

    def remove(self, name: str) -> None:
        """Forget a worker that left (mark_dead it first; nothing of its load is left)."""
        self.mark_dead(name)
        self._prefill.pop(name, None)
        self._decode.pop(name, None)

    def load(self, name: str) -> PrefillLoad | DecodeLoad | None:
        """The coordinator's accounting of one worker (alive or not), for reading; None if unknown."""
        return self._prefill.get(name) or self._decode.get(name)
