"""Sequence: one request's tokens, KV blocks and progress through prefill and decode; ScheduledChunk: the part of a
sequence that goes into one step (what the scheduler hands the runner)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"          # queued, or preempted and waiting to recompute its KV
    RUNNING = "running"          # holds blocks; scheduled every step until done
    PREFILLED = "prefilled"      # prefill-only request done: KV kept in blocks until released
    FINISHED = "finished"        # done; blocks returned to the pool


class Sequence:
    """Mutable per-request state owned by the engine's scheduler.

    token_ids holds prompt + generated tokens. num_computed_tokens counts the leading tokens whose
    K/V are in the sequence's blocks; the rest are computed by the next scheduled steps. A resumed
    request (one that continues elsewhere after its worker died) arrives with its already generated
    tokens at the end of `known_token_ids`; num_resumed_tokens says how many, so they count as output.

    A request with n > 1 samples is n sequences with the same request_id, `index` 0..n-1. Sample 0 is
    scheduled and prefills the prompt; the others wait in its `forks` until its prefill samples, then each
    takes its own first token from the same logits and a block table that shares the prompt's full blocks.
    """

    def __init__(self, request_id: str, known_token_ids: list[int], params: SamplingParams,
                 *, prefill_only: bool = False, arrival_time: float | None = None,
                 num_resumed_tokens: int = 0, index: int = 0) -> None:
        self.request_id = request_id
        self.index = index
        self.forks: list[Sequence] = []  # samples 1..n-1 waiting for this one's prefill (sample 0's only)
        self.token_ids: list[int] = list(known_token_ids)
        self.num_prompt_tokens = len(known_token_ids) - num_resumed_tokens
        self.params = params
        self.prefill_only = prefill_only
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        # tokens a launched step samples for this sequence that have not reached the host yet (async scheduling:
        # at most 1; the scheduler counts them as known, the runner feeds them from the device)
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0       # prompt tokens served by the prefix cache (stats)
        self.num_hashed_blocks = 0       # leading full blocks registered in the prefix cache
        self.block_hashes: list[bytes] = []  # chained sha256 digests of the full blocks
        self.num_preemptions = 0
        self.arrival_time = arrival_time if arrival_time is not None else time.perf_counter()
        self.first_token_time: float | None = None
        # structured outputs: the sequence's grammar state (engine/structured/ SequenceGrammar), set once its
        # grammar compiled, advanced by each token it gets; None for unconstrained sequences
        self.grammar = None
        # params.prompt_logprobs: one entry per prompt token, the first None, filled as the prefill runs
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V the next steps compute: the known ones past num_computed_tokens, and a pending one."""
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.PREFILLED)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}[{self.index}], {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")


@dataclass(frozen=True)
class ScheduledChunk:
    """num_new_tokens tokens of seq, starting at seq.num_computed_tokens, go into this step."""

    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token (a pending one included), so a next token is
        sampled."""
        seq = self.seq
        return seq.num_computed_tokens + self.num_new_tokens == seq.num_tokens + seq.num_pending_tokens
