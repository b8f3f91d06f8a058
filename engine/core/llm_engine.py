"""LLMEngine: the step loop. add requests, call step() until done, read deltas.

One step = schedule -> one packed forward -> sample -> update sequences -> emit deltas; with async scheduling the
host schedules step N + 1 while the device runs step N (engine/core/step_pipeline.py).
Requests come in three kinds:
- full (colocated): prefill then decode here;
- prefill-only (prefill workers): prefill, sample the first token, keep the KV blocks for transfer;
- prefilled (decode workers): KV already written into reserved blocks, decode from the first token.
Not thread-safe: one thread drives an engine.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq

import torch

from engine.attention import select_backend
from engine.config import EngineConfig, ModelConfig, max_model_len
from engine.core.kv_handoff import KVHandoff
from engine.core.live_requests import LiveRequests
from engine.core.request_checks import check_prefilled, check_request, check_step_budget
from engine.core.scheduler import Scheduler, prefill_first_enabled
from engine.core.stats import EngineStats
from engine.core.step_log import StepLog, StepRecord, chunk_tokens
from engine.core.step_observer import StepObserver
from engine.core.step_pipeline import InFlightStep, StepPipeline
from engine.core.warmup import warm_up
from engine.core.structured_requests import StructuredRequests
from engine.core.stop_rules import finish_reason, is_stop_token
from engine.kv.kv_cache import KVCache, KVCacheSpec
from engine.model.causal_lm import CausalLM, local_heads
from engine.outputs import OutputText, RequestMetrics, StepDelta
from engine.runner.device_memory import release_device_memory
from engine.runner.host_malloc import keep_freed_host_memory
from engine.runner.memory_plan import plan_memory
from engine.runner.model_runner import ModelRunner
from engine.step_io import StepIO
from engine.sampling.logprobs import TokenLogprobs
from engine.sampling.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceStatus
from engine.text.tokenizer import Tokenizer

logger = logging.getLogger("tandem.engine")


class EngineClosed(RuntimeError):
    """The engine was closed (LLMEngine.close): its model and KV pool are gone, it takes no more work."""


class LLMEngine(KVHandoff):
    """See the module docstring; the KV hand-off calls (reserve_blocks, pin_cached_prefix, free_blocks,
    release_prefilled, take_prefilled_blocks) are in engine/core/kv_handoff.py."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, model_config: ModelConfig,
                 config: EngineConfig, dtype: torch.dtype, device: torch.device, tp_leader=None) -> None:
        """tp_leader (engine/runner/tp_leader.py): model is rank 0's shard, the leader's followers run each step
        with it; close() stops them. None: one rank."""
        self.model_config, self.config, self.tokenizer = model_config, config, tokenizer
        self.device, self.dtype, self.tp_leader = device, dtype, tp_leader
        if device.type == "cpu":
            keep_freed_host_memory()  # steps reuse their activations' memory instead of page-faulting it in
        spec = KVCacheSpec(model_config.num_layers, local_heads(model_config, model.shard)[1], model_config.head_dim,
                           config.block_size, dtype)
        attention = select_backend(config.attention_backend, device, dtype)
        self.memory_plan = plan_memory(model, spec, config, device, attention)  # measured on CUDA, logged
        pool = KVCache if tp_leader is None else tp_leader.kv_cache  # TP: as many blocks as every rank holds
        self.kv_cache = pool(spec, self.memory_plan.num_blocks, device, config.enable_prefix_caching)
        if config.kv_cache_resident:
            self.kv_cache.commit_host_pages()  # CPU: no K/V store waits on a page fault (logged)
        num_blocks = self.kv_cache.num_blocks
        self.max_model_len = max_model_len(model_config, config, num_blocks)
        check_step_budget(config, self.max_model_len)
        self.scheduler = Scheduler(config, self.kv_cache.allocator, prefill_first_enabled(config, device.type),
                                   self.max_model_len, config.prefill_bound_on(device.type))
        io = StepIO(device)  # a step's copies: one upload of its inputs, one copy of its picks back
        sampler = Sampler(config.seed, eos_token_ids=tokenizer.eos_token_ids, start_copy=io.start_to_host)
        self.runner = ModelRunner(model, self.kv_cache, sampler, device, attention=attention,
                                  step_sender=None if tp_leader is None else tp_leader.send_step, io=io)
        self.runner.capture_graphs(config, self.max_model_len)
        overlap = config.async_scheduling_on(device.type)
        self.pipeline = StepPipeline(self.runner, self.scheduler, self.kv_cache, overlap)
        self.structured = StructuredRequests(tokenizer, model_config.vocab_size, sampler)  # structured outputs
        self.stats, self.step_log = EngineStats(), StepLog()  # counters; the last steps: what each held and cost
        self._live = LiveRequests()
        self._closed = False
        if config.warmup or (config.warmup is None and device.type == "cuda"):
            warm_up(self)  # every kind of step once: no request pays for a compile

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Abort every live request (their blocks freed), then let go of the model, the KV pool and the decode
        graphs and give their device memory back (release_device_memory). Idempotent. Afterwards the calls
        that start work (add_request, add_prefilled_request, reserve_blocks, pin_cached_prefix, step,
        take_prefilled_blocks) and the block counts raise EngineClosed; abort, release_prefilled and
        free_blocks find nothing left to free. Call it from the thread that steps the engine."""
        if self._closed:
            return
        if self.step_log.records():
            logger.info("%s", self.step_log.summary())
        for request_id in self._live.request_ids():
            self.abort(request_id)
        self.pipeline.close()  # a running step completes: every sequence aborted, its picks are dropped
        self._closed = True
        self.structured.close()
        self.runner.close()
        self.runner = self.kv_cache = None
        if self.tp_leader is not None:
            self.tp_leader.close()
        release_device_memory(self.device)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed("this engine is closed: LLMEngine.close() released its model and KV pool")

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                    *, prefill_only: bool = False, arrival_time: float | None = None,
                    num_resumed_tokens: int = 0) -> None:
        """Queue a request (validated: ValueError on bad input, nothing changes then).

        num_resumed_tokens > 0 resumes a request that another engine started: the last that many of
        prompt_token_ids are tokens it already generated. They count towards max_tokens and stop
        checks, and the text deltas continue exactly where that engine's would have: the same tokens
        (greedy, or seeded: draws depend on (seed, position)), and none of the resumed text again.

        params.n > 1 (full requests only, at most max_num_seqs): n samples of the prompt, each with
        params.for_sample(j); the prompt is prefilled once and its KV shared (engine/core/fork.py); each
        sample's deltas carry its `index`, and the request ends when every sample has. A structured request waits
        for its grammar outside the schedule (engine/core/structured_requests.py)."""
        self._validate(request_id, prompt_token_ids, params, num_resumed_tokens)
        if params.n > 1 and (prefill_only or num_resumed_tokens or params.n > self.config.max_num_seqs):
            raise ValueError(f"n={params.n} needs a full request (not prefill-only, not resumed) and at most "
                             f"max_num_seqs={self.config.max_num_seqs} samples")
        samples = [Sequence(request_id, list(prompt_token_ids), params.for_sample(j), prefill_only=prefill_only,
                            arrival_time=arrival_time, num_resumed_tokens=num_resumed_tokens, index=j)
                   for j in range(params.n)]
        samples[0].forks = samples[1:]
        held = self.structured.hold(samples[0])  # raises before anything is tracked
        for seq in samples:
            self._track(seq)
        if not held:
            self.scheduler.add_waiting(samples[0])

    def add_prefilled_request(self, request_id: str, prompt_token_ids: Seq[int], first_token: int,
                              params: SamplingParams, block_ids: Seq[int],
                              arrival_time: float | None = None, num_resumed_tokens: int = 0,
                              first_logprobs=None) -> StepDelta:
        """Admit a request whose prompt KV already sits in block_ids (from reserve_blocks; a decode worker's
        leading blocks may be cached ones it pinned with pin_cached_prefix).

        The sequence owns the blocks from here on (they are freed when it ends). Returns the first
        token's delta, final already if that token ends the request (max_tokens=1, EOS, stop);
        otherwise decoding continues in the following steps. num_resumed_tokens: as in add_request
        (the KV in block_ids then covers the resumed tokens too). first_logprobs: the first token's
        logprobs from the engine that sampled it (anything with logprob, rank, top_ids, top_logprobs),
        required when params.logprobs is set.
        """
        self._validate(request_id, prompt_token_ids, params, num_resumed_tokens)
        check_prefilled(request_id, len(prompt_token_ids), first_token, params, first_logprobs is not None,
                        len(block_ids), self.config.block_size, self.model_config.vocab_size)
        logprobs = None if params.logprobs is None else TokenLogprobs.of(first_token, first_logprobs, params.logprobs)
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival_time=arrival_time,
                       num_resumed_tokens=num_resumed_tokens)
        seq.block_table = list(block_ids)
        seq.num_computed_tokens = len(prompt_token_ids)
        self.structured.attach_now(seq)
        self._track(seq)
        self.scheduler.add_running(seq)
        self.scheduler.register_full_blocks(seq)
        return self._append_token(seq, first_token, logprobs)

    def _track(self, seq: Sequence) -> None:
        prompt = seq.token_ids[:seq.num_prompt_tokens]
        self._live.add(seq, OutputText.create(self.tokenizer, prompt, seq.params,
                                              resumed_token_ids=seq.output_token_ids))

    def _validate(self, request_id: str, prompt: Seq[int], params: SamplingParams,
                  num_resumed_tokens: int = 0) -> None:
        self._check_open()
        if isinstance(request_id, str) and request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_request(request_id, prompt, params, num_resumed_tokens, self.max_model_len,
                      self.model_config.vocab_size)
        self.structured.check(params)

    # ---- the step loop ---------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work or self.structured.has_pending or self.pipeline.in_flight is not None

    def step(self, observer: StepObserver | None = None) -> list[StepDelta]:
        """Run one packed forward over the scheduled chunks and return the deltas of the step that completed:
        this one, or with async scheduling the one before it (engine/core/step_pipeline.py), this one still
        running on the device while the host appends the other's tokens.

        observer (a prefill worker streaming KV layer by layer) is told, before the forward, which
        prefill-only requests this step completes (their block tables are final: every prompt token has
        a slot), and gets per-layer callbacks during it; if the forward raises, forward_failed(error) runs
        before the exception propagates. A step with an observer never overlaps another."""
        self._check_open()
        started = time.perf_counter()
        deltas = [self._finish(s, "abort", (), {"index": s.index}) for s in self.structured.release(self.scheduler)]
        if observer is not None and self.pipeline.in_flight is not None:
            deltas += self._complete(self.pipeline.in_flight)  # a streaming step never overlaps another
        chunks = self.scheduler.schedule()
        if not chunks:
            return deltas + (self._complete(self.pipeline.in_flight) if self.pipeline.in_flight else [])
        launched = self.pipeline.launch(chunks, observer, started)
        previous, self.pipeline.in_flight = self.pipeline.in_flight, launched
        if previous is not None:
            deltas += self._complete(previous)
        if launched.needs_host:  # no overlap, or the next step reads its picks on the host
            deltas += self._complete(launched)
        return deltas

    def _complete(self, step: InFlightStep) -> list[StepDelta]:
        """Settle a launched step (waits for its picks) and append them: its deltas."""
        if self.pipeline.in_flight is step:
            self.pipeline.in_flight = None
        completed = self.pipeline.complete(step)
        self.stats.record_step(list(step.chunks), completed.forward_s)
        deltas = [self._append_token(seq, token, logprobs) for seq, token, logprobs in completed.picks]
        self.step_log.record(StepRecord(completed.began, completed.forward_s, time.perf_counter() - completed.began,
                                        *chunk_tokens(list(step.chunks)), step.issue_s, completed.device_s))
        return deltas

    def _append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None) -> StepDelta:
        first = seq.first_token_time is None
        if first:
            seq.first_token_time = time.perf_counter()
        seq.token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        text = self._live.text(seq)
        may_stop = seq.num_output_tokens > seq.params.min_tokens  # min_tokens: no stop of any kind before
        stop_token = may_stop and is_stop_token(seq.params, token, self.tokenizer.eos_token_ids)
        # a stop token (EOS, stop_token_ids) that ends the request is not detokenized unless the request
        # keeps stop strings in its output (vLLM's rule)
        hit = False if stop_token and not seq.params.include_stop_str_in_output else \
            text.append([token], check_stop=may_stop)
        reason = finish_reason(seq, hit or stop_token, may_stop, self.max_model_len)
        extras = {"logprobs": (logprobs,) if logprobs is not None else None, "index": seq.index,
                  "prompt_logprobs": tuple(seq.prompt_logprobs) if first and seq.prompt_logprobs else None}
        if reason is not None:
            return self._finish(seq, reason, (token,), extras)
        if seq.prefill_only:
            self.scheduler.finish(seq, SequenceStatus.PREFILLED, keep_blocks=True)
            return StepDelta(seq.request_id, (token,), text.take_delta(final=True),
                             kv_block_ids=tuple(seq.block_table), metrics=RequestMetrics.of(seq), **extras)
        return StepDelta(seq.request_id, (token,), text.take_delta(final=False), **extras)

    def _finish(self, seq: Sequence, reason: str, new_tokens: tuple[int, ...], extras: dict) -> StepDelta:
        """The sample's last delta; extras: its StepDelta fields logprobs, index, prompt_logprobs."""
        seq.finish_reason = reason
        self.scheduler.finish(seq, SequenceStatus.FINISHED)
        text = self._live.remove(seq)
        text.finish()
        return StepDelta(seq.request_id, new_tokens, text.take_delta(final=True), finish_reason=reason,
                         metrics=RequestMetrics.of(seq), **extras)

    # ---- ending requests -------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Drop a live request (every sample) wherever it is and free its blocks; False if it is unknown or
        done."""
        samples = self._live.samples(request_id)
        if not samples:
            return False
        for seq in samples:
            if seq.status == SequenceStatus.PREFILLED:
                self.release_prefilled(request_id)
                continue
            seq.finish_reason = "abort"
            self.scheduler.finish(seq, SequenceStatus.FINISHED)
            self._live.remove(seq)
        self.pipeline.settle_if_unwatched()  # the running step sampled only for what is gone now
        return True

    def get_sequence(self, request_id: str) -> Sequence | None:
        """The live (waiting, running or prefilled) request with this id, if any (of n samples, the first live)."""
        return self._live.first(request_id)

    @property
    def num_live_requests(self) -> int:
        return len(self._live)

    @property
    def num_free_blocks(self) -> int:
        self._check_open()
        return self.kv_cache.allocator.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        self._check_open()
        return self.kv_cache.num_blocks
