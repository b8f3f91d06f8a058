"""Scheduler: which tokens of which sequences go into the next forward pass.

Each step has a token budget (max_num_batched_tokens). Running sequences are served first, oldest
first: a decoding sequence takes one token, a sequence in the middle of a chunked prefill takes the
next chunk (Sarathi's stall-free batching: decodes never wait for a long prompt). What budget is left
admits waiting sequences in arrival order (FCFS), after looking their prompts up in the prefix cache.
With long_prefill_token_threshold set, no prompt takes more than that many tokens of one step, so the
prompts behind a long one get into the same step instead of waiting for the whole long prefill.
When a sequence needs a block and none is free, the newest running sequence is preempted: its blocks
are freed and it goes back to the head of the queue to recompute its KV later (preemption by recompute).

Prefill first (prefill_first): while sequences decode, waiting prompts that one step can finish, of at most
PREFILL_FIRST_TOKENS_PER_DECODE tokens together per decoding sequence, get a step of their own ahead of the
decodes; the next step serves the running sequences first again, so a decode waits at most one such step
between two tokens. Where a step's cost grows with its tokens (CPU: compute-bound at any batch), a short prompt
mixed into a decode step makes its first token wait for the whole decode batch, while in its own step it costs
about what mixing adds. The token bound keeps that step about as dear as the decode step it goes ahead of at
most: a longer prompt in a step of its own would hold every decode for its whole prefill without a token,
where mixed in, the decodes ride along for a few rows (served, 512-token prompts at 1 req/s against ~10
decodes: TPOT 220-251 vs 255-267 ms, ITL p99 0.8-1.0 vs 1.6 s; docs/benchmarks.md). Where a step costs
about the same whatever it carries (a GPU at small batch reads every weight each step), mixing is
free and an extra step only delays the decodes. A prompt that needs several chunks would gain nothing from a
first chunk of its own (its first token comes after the last one), so such
prompts are mixed as usual, and the prompts behind them wait their turn (FCFS). Hence on for CPU and off for
CUDA by default (EngineConfig.prefill_first "auto").

The bound on prompt tokens beside decodes (prefill_bound) can give way to a backlog: with
EngineConfig.prefill_backlog_steps N > 0, a step that holds decodes may take the prompt tokens still to compute
(waiting prompts, and the rest of prompts mid-prefill) over N, when that is more than the bound: a queue is worked
down in about N steps, whatever its length, and one shorter than N bounded steps keeps the bound. Bounded steps
protect the gap between two tokens when prompts arrive about as fast as they are computed; behind a queue they
only slow the prefill down, since every bounded step carries the whole decode batch once more (served on 2 cores
at 3 req/s of 512-token prompts: 780-890 ms a bounded step against 2.6-2.7 s for four prompts, 1.5-1.7 against
1.3 ms a prompt token; TTFT p99 18 s against 23-33 s; docs/benchmarks.md). The budget grows with the queue rather
than jumping: a first rule, the whole budget once more than N bounded steps waited, let a queue of five prompts
build near saturation (1 req/s of them) and then took four at a time, every decode waiting ~3 s a step. Off by
default: spread over 4 steps, it served about what the strict bound serves at 3 req/s (60-66 against 62-68 tok/s)
with longer gaps between tokens (ITL p99 3-4 s against 1.0-1.1 s).
"""
from __future__ import annotations

from collections import deque

from engine.config import EngineConfig
from engine.kv.block_allocator import BlockAllocator
from engine.sequence import ScheduledChunk, Sequence, SequenceStatus

# A prompt token costs a quarter to a sixth of a decode row on CPU (a decode row reads its whole context):
# 0.10 vs 0.61 ms on one thread (64 prompt tokens, 25 decodes), 1.4 vs 6 ms on two (512 tokens, ~15 decodes).
PREFILL_FIRST_TOKENS_PER_DECODE = 4


def prefill_first_enabled(config: EngineConfig, device_type: str) -> bool:
    """EngineConfig.prefill_first resolved for a device type ("auto": on for CPU, off for CUDA)."""
    return config.prefill_first == "on" or (config.prefill_first == "auto" and device_type == "cpu")


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: BlockAllocator, prefill_first: bool = False,
                 max_model_len: int | None = None, prefill_bound: int = 0) -> None:
        """prefill_first: while sequences decode, waiting prompts one step finishes get a step of their own
        (see the module docstring). max_model_len: the engine's context limit (a sequence whose pending token
        reaches it is not scheduled again). prefill_bound: the prompt tokens a step may take while sequences
        decode (0: no bound), as EngineConfig.prefill_bound_on resolves it for the engine's device."""
        self.config = config
        self.prefill_bound = prefill_bound
        self.max_model_len = max_model_len
        self.prefill_first = prefill_first
        self._last_was_prompts_only = False
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_waiting(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose blocks and KV are already in place (decode-only requests)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """Put a sequence that holds no block at the head of the queue (a sample that could not fork)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def schedule(self) -> list[ScheduledChunk]:
        """Pick this step's chunks. Changes block tables (allocation, preemption) and the queues."""
        budget = self.config.max_num_batched_tokens
        decoding = self._num_decoding()
        prompt_budget = self._prompt_budget(budget) if decoding else budget
        if self.prefill_first and self.waiting and not self._last_was_prompts_only and decoding:
            # []: no prompt finishes within the bound now: the usual step
            prompts = self._admit_waiting(min(prompt_budget, PREFILL_FIRST_TOKENS_PER_DECODE * decoding),
                                          whole_only=True)
            self._last_was_prompts_only = bool(prompts)
            if prompts:
                return prompts
        self._last_was_prompts_only = False
        chunks, preempted = self._schedule_running(budget, prompt_budget)
        budget -= sum(c.num_new_tokens for c in chunks)
        prompt_budget -= sum(c.num_new_tokens for c in chunks if c.seq.num_uncomputed_tokens > 1)
        if not preempted:
            chunks += self._admit_waiting(min(budget, prompt_budget))
        return chunks

    def _prompt_budget(self, budget: int) -> int:
        """The prompt tokens a step that holds decodes may take: the bound (none: the budget), or with
        prefill_backlog_steps N > 0 the prompt tokens still to compute over N when that is more (see the
        module's docstring); never more than the budget."""
        bound, steps = self.prefill_bound, self.config.prefill_backlog_steps
        if not bound:
            return budget
        if not steps:
            return min(budget, bound)
        spread = -(-self._pending_prompt_tokens(limit=steps * budget) // steps)  # rounded up
        return min(budget, max(bound, spread))

    def _pending_prompt_tokens(self, limit: int) -> int:
        """Prompt tokens not computed yet: the rest of running prompts mid-prefill and the waiting sequences'.
        Counting stops past limit: a long queue costs no more than a short one."""
        pending = sum(seq.num_uncomputed_tokens for seq in self.running if seq.num_uncomputed_tokens > 1)
        for seq in self.waiting:
            if pending > limit:
                break
            pending += seq.num_uncomputed_tokens
        return pending

    def _num_decoding(self) -> int:
        """Running sequences waiting for their next token (a prefill worker's never do: it packs prompts)."""
        return sum(1 for seq in self.running
                   if seq.num_output_tokens + seq.num_pending_tokens and seq.num_uncomputed_tokens == 1)

    def _schedule_running(self, budget: int, prompt_budget: int) -> tuple[list[ScheduledChunk], bool]:
        """Running sequences in order: a decode takes its token, a prompt's next chunk fits what is left of
        prompt_budget too (a prompt with none left skips this step)."""
        chunks, preempted, index = [], False, 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if self._waits_for_host(seq):
                index += 1
                continue
            is_prompt = seq.num_uncomputed_tokens > 1
            num_new = self._chunk_size(seq, min(budget, prompt_budget) if is_prompt else budget)
            if num_new == 0:
                index += 1
                continue
            while not self._grow_blocks(seq, seq.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    return chunks, preempted
            chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
            prompt_budget -= num_new if is_prompt else 0
            index += 1
        return chunks, preempted

    def _admit_waiting(self, budget: int, whole_only: bool = False) -> list[ScheduledChunk]:
        """Waiting sequences in arrival order while they fit; whole_only: only prompts this step finishes."""
        chunks = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.num_pending_tokens:  # preempted while its last step ran: admitted once that step completed
                break
            if len(self.running) + 1 + len(seq.forks) > self.config.max_num_seqs:  # its samples run too
                break
            self._attach_cached_prefix(seq)
            num_new = self._chunk_size(seq, budget)
            whole = num_new == seq.num_uncomputed_tokens
            if (not whole and (whole_only or not self.config.enable_chunked_prefill)) or \
                    not self._grow_blocks(seq, seq.num_computed_tokens + num_new):
                self._release_blocks(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
        return chunks

    def _waits_for_host(self, seq: Sequence) -> bool:
        """Async scheduling: a sequence whose last token is still on its way to the host sits this step out when
        that token may be its last (max_tokens, the context limit). Stop tokens and strings cannot be foreseen:
        their sequence computes one token more, which the engine drops. (Picks that end a prefill-only request's
        prefill or fork samples never pend: engine/core/step_pipeline.py.)"""
        if not seq.num_pending_tokens:
            return False
        known = seq.num_tokens + seq.num_pending_tokens
        return known - seq.num_prompt_tokens >= seq.params.max_tokens or \
            (self.max_model_len is not None and known >= self.max_model_len)

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute this step: what is left, within the budget and, for a prompt
        (more than one token left), within long_prefill_token_threshold when that is set."""
        num_new = min(seq.num_uncomputed_tokens, budget)
        threshold = self.config.long_prefill_token_threshold
        return min(num_new, threshold) if threshold and num_new > 1 else num_new

    def _attach_cached_prefix(self, seq: Sequence) -> None:
        # Leave at least the last token to compute: its hidden state gives the next token's logits. A
        # request still owed prompt logprobs computes every prompt position: no cache.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
            max_blocks = 0
        block_ids, hashes = self.allocator.lookup_prefix(seq.token_ids, max_blocks)
        seq.block_table = block_ids
        seq.block_hashes = hashes
        seq.num_hashed_blocks = len(block_ids)
        seq.num_computed_tokens = len(block_ids) * self.block_size
        if seq.num_output_tokens == 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    def _grow_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Make seq's block table cover num_tokens tokens; False (nothing changed) if blocks are short."""
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        new_blocks = self.allocator.allocate(needed)
        if new_blocks is None:
            return False
        seq.block_table.extend(new_blocks)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release_blocks(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release_blocks(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish seq's newly completed full blocks to the prefix cache (blocks of known tokens only: with async
        scheduling a computed position's token may still be on its way to the host)."""
        size = self.block_size
        known = min(seq.num_computed_tokens, seq.num_tokens)
        while (seq.num_hashed_blocks + 1) * size <= known:
            i = seq.num_hashed_blocks
            parent = seq.block_hashes[i - 1] if i else None
            tokens = seq.token_ids[i * size:(i + 1) * size]
            seq.block_hashes.append(self.allocator.register_full_block(seq.block_table[i], parent, tokens))
            seq.num_hashed_blocks += 1

    def finish(self, seq: Sequence, status: SequenceStatus, keep_blocks: bool = False) -> None:
        """Take seq out of the queues; free its blocks unless keep_blocks (prefill-only results)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        if not keep_blocks:
            self.allocator.free(seq.block_table)
            seq.block_table = []
