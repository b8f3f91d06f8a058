"""The coordinator's accounting of one worker's load, which the Router (routing.py) keeps and the KV-aware order
(kv_routing.py) scores: a decode worker's blocks and requests, a prefill worker's queued prompt tokens."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecodeLoad:
    """A decode worker (or a colocated replica): its pool, what the requests routed to it may hold, its requests."""

    name: str
    total_blocks: int
    claimed_blocks: int = 0
    running: int = 0
    queued_tokens: int = 0   # prompt tokens it prefills itself that have not produced their first token
    alive: bool = True

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.claimed_blocks


@dataclass
class PrefillLoad:
    """A prefill worker: the prompt tokens dispatched to it and not yet reported."""

    name: str
    queued_tokens: int = 0
    alive: bool = True
