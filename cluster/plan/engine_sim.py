"""SimEngine: one engine's scheduler, without a model, for the planner's simulation.

It picks each step's chunks by the rules of engine/core/scheduler.py (running sequences first, oldest first: a
decoding sequence takes one token, a sequence in the middle of its prefill its next chunk; then waiting
sequences in arrival order, within the step's token budget, `long_prefill_token_threshold` tokens of one
prompt at most, and `max_num_seqs` running; with `prefill_first`, while sequences decode, waiting prompts
one step can finish, of at most PREFILL_FIRST_TOKENS_PER_DECODE tokens per decoding sequence, get a step of
their own before the running ones, never two such steps in a row).
What it leaves out: the KV pool (no preemption: the planner assumes the pool holds every running request)
and the prefix cache (no hits: every prompt is computed).
tests/plan/ check its chunks against the real Scheduler's on the same arrivals.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cluster.plan.step_model import StepWork
from engine.core.scheduler import PREFILL_FIRST_TOKENS_PER_DECODE


@dataclass(frozen=True)
class EngineLimits:
    """The engine flags that shape a step (EngineConfig's names)."""

    max_num_batched_tokens: int
    long_prefill_token_threshold: int = 0
    max_num_seqs: int = 256
    prefill_first: bool = False   # EngineConfig.prefill_first as the device resolves it

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.long_prefill_token_threshold < 0:
            raise ValueError(f"engine limits need a token budget and max_num_seqs >= 1 and a threshold >= 0, "
                             f"got {self}")


@dataclass(eq=False)
class SimSequence:
    """One request inside a SimEngine. `prefill_only`: it leaves the engine once its first token is sampled
    (a prefill worker's request); otherwise it leaves after `output_len` tokens in all."""

    request: int                  # index of the request in the simulated workload
    prompt_len: int
    output_len: int
    prefill_only: bool = False
    num_computed: int = 0         # tokens whose KV is in the engine
    num_generated: int = 0        # output tokens sampled so far (here or, before a transfer, elsewhere)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_generated

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_done(self) -> bool:
        return self.num_generated >= self.output_len or (self.prefill_only and self.num_generated >= 1)


@dataclass(frozen=True)
class Chunk:
    """`new` tokens of `seq`, after `start` already computed ones, in one step."""

    seq: SimSequence
    new: int
    start: int


@dataclass
class SimEngine:
    """The queues of one engine and the chunks of its next step. Not a clock: the simulation calls
    `schedule` when a step starts and `finish_step` when it ends."""

    limits: EngineLimits
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    last_was_prompts_only: bool = False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_waiting(self, seq: SimSequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: SimSequence) -> None:
        """A sequence whose prompt KV is already here (a decode worker's request after its transfer)."""
        self.running.append(seq)

    def schedule(self) -> list[Chunk]:
        """This step's chunks, as engine/core/scheduler.py picks them; moves admitted sequences to running."""
        budget, chunks = self.limits.max_num_batched_tokens, []
        decoding = sum(1 for seq in self.running if seq.num_generated and seq.num_uncomputed == 1)
        if self.limits.prefill_first and self.waiting and decoding and not self.last_was_prompts_only:
            prompts = self._admit(min(budget, PREFILL_FIRST_TOKENS_PER_DECODE * decoding), whole_only=True)
            self.last_was_prompts_only = bool(prompts)
            if prompts:
                return prompts
        self.last_was_prompts_only = False
        for seq in self.running:
            if budget <= 0:
                break
            new = self._chunk_size(seq, budget)
            chunks.append(Chunk(seq, new, seq.num_computed))
            budget -= new
        return chunks + self._admit(budget)

    def _admit(self, budget: int, whole_only: bool = False) -> list[Chunk]:
        """Waiting sequences in arrival order, within `budget` and max_num_seqs (whole_only: while this step
        finishes their prompt); they move to running."""
        chunks = []
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            new = self._chunk_size(self.waiting[0], budget)
            if whole_only and new < self.waiting[0].num_uncomputed:
                break
            seq = self.waiting.popleft()
            self.running.append(seq)
            chunks.append(Chunk(seq, new, seq.num_computed))
            budget -= new
        return chunks

    def _chunk_size(self, seq: SimSequence, budget: int) -> int:
        new = min(seq.num_uncomputed, budget)
        threshold = self.limits.long_prefill_token_threshold
        return min(new, threshold) if threshold and new > 1 else new

    def finish_step(self, chunks: list[Chunk]) -> list[SimSequence]:
        """Applies a step's chunks: the sequences whose chunk reached their last token sample one; those
        now done leave the engine. Returns the sequences that sampled a token, in chunk order."""
        sampled = []
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed += chunk.new
            if seq.num_computed == seq.num_tokens:
                seq.num_generated += 1
                sampled.append(seq)
        done = {id(seq) for seq in sampled if seq.is_done}
        if done:
            self.running = [seq for seq in self.running if id(seq) not in done]
        return sampled


def step_work(chunks: list[Chunk]) -> StepWork:
    """The StepWork of a step: one-token chunks after the prompt are decode rows (context = the tokens
    the row attends to, itself included), every other chunk is prefill."""
    prefill = tuple((c.new, c.start) for c in chunks if not _is_decode(c))
    decode = tuple(c.start + 1 for c in chunks if _is_decode(c))
    return StepWork(prefill, decode)


def _is_decode(chunk: Chunk) -> bool:
    return chunk.new == 1 and chunk.start >= chunk.seq.prompt_len
