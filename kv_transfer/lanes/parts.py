"""Lane parts: which sending rank ships which KV heads to which receiving rank, for groups of any two layouts.

Each receiving rank needs exactly its own heads. Between groups of one layout rank i ships its heads to rank i (one
part each). Otherwise a receiving rank's heads may be spread over several sending ranks (a wider prefill group:
the part merge on the receiving rank, each landing in its heads of the same blocks), or one sending rank may hold the
heads of several receiving ranks (a narrower one: it ships each of them its share). Where KV heads are replicated
(fewer KV heads than ranks) one of the ranks that hold a head ships it: the one of the same index when it holds it,
else the one that ships the fewest parts so far.

    prefill TP=2 [h0] [h1]        prefill TP=1 [h0 h1]
                   \\   /                        /    \\
    decode  TP=1 [h0 h1]         decode  TP=2 [h0]  [h1]
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Span = tuple[int, int]  # the model's KV heads [start, stop)


@dataclass(frozen=True)
class LanePart:
    """One transfer of a request's KV: heads `heads` of its blocks, from sending rank `sender` to receiving rank
    `receiver`."""

    sender: int
    receiver: int
    heads: Span

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]


def plan_parts(sender_heads: Sequence[Span], receiver_heads: Sequence[Span]) -> tuple[LanePart, ...]:
    """The parts that give every receiving rank (receiver_heads[r]: its heads) all of its heads, each head once, from
    sending ranks that hold it (sender_heads[s]); consecutive heads from one sending rank travel as one part. Between
    groups of one layout: rank i to rank i, whole. ValueError when a receiving rank holds a head no sending rank
    holds (the groups serve different models)."""
    load = [0] * len(sender_heads)
    parts = []
    for receiver, (start, stop) in enumerate(receiver_heads):
        head = start
        while head < stop:
            holders = [sender for sender, (first, end) in enumerate(sender_heads) if first <= head < end]
            if not holders:
                raise ValueError(f"KV head {head} of receiving rank {receiver} is held by no sending rank "
                                 f"(sending ranks hold {list(sender_heads)})")
            sender = receiver if receiver in holders else min(holders, key=lambda rank: (load[rank], rank))
            end = min(stop, sender_heads[sender][1])
            parts.append(LanePart(sender, receiver, (head, end)))
            load[sender] += 1
            head = end
    return tuple(parts)

