"""ModelRunner: turns a step's scheduled chunks into one packed batch, runs it, samples.

Batch order: single-token chunks first (they share one batched attention call), then prefill chunks.
Only rows that finish a sequence's known tokens are sampled (logits skipping): the LM head never
sees the other prompt tokens. The sampler's host half runs while the step is prepared, so what it needs on the
device (per-row parameters, grammar bitmasks, penalty histories, prompt-logprob rows) crosses in the step's one
upload; the picks, their logprobs and the prompt logprobs come back in one copy. `launch` stops once the picks are
on the device and on their way to the host (LaunchedStep): an async engine schedules the next step meanwhile, whose
rows take those picks on the device.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, AttentionMetadata, select_backend
from engine.attention.block_tables import BlockTableMirrors
from engine.attention.metadata import StepCounts, query_starts, step_tensors, table_width
from engine.config import EngineConfig
from engine.host_lists import HostCopy, Uploads
from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.parallel.step_message import StepInputs
from engine.runner.decode_graphs import UPDATE_CAPACITY, DecodeBatch, DecodeGraphs, decode_graphs_for
from engine.runner.device_tables import DeviceBlockTables, TableUpdates
from engine.runner.mixed_graphs import MixedGraphs, mixed_graphs_for
from engine.runner.step_batch import HostBatch, feed_tokens, host_batch, stage_eager
from engine.step_io import StepIO
from engine.sampling.logprobs import TokenLogprobs
from engine.sampling.prompt_logprobs import (PromptPlan, plan_prompt_logprobs, prompt_logprob_tensors,
                                             unpack_prompt_logprobs)
from engine.sampling.sampler import DevicePicks, Sampler, SamplerOutput, StepSampling
from engine.sequence import ScheduledChunk, Sequence


@dataclass(frozen=True)
class StepResult:
    """What one forward gave: the sampled sequences with their picks, and prompt logprobs (sequence, entry)
    in prompt order."""

    seqs: tuple[Sequence, ...]
    sampled: SamplerOutput
    prompt_logprobs: list[tuple[Sequence, TokenLogprobs]]


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose forward and sampling are issued: its picks on the device, their copy to the host under way."""

    seqs: tuple[Sequence, ...]          # the sequence each pick goes to
    picks: DevicePicks | None           # None when the step samples nothing
    prompt: PromptPlan | None = None    # the prompt-logprob rows it computes (their values behind the picks) ...
    prompt_copy: HostCopy | None = None  # ... or in a copy of their own when the step samples nothing

    def result(self) -> StepResult:
        """The picks and prompt logprobs on the host (waits for their copy)."""
        sampled = self.picks.result() if self.picks is not None else SamplerOutput([], [])
        if self.prompt is None:
            return StepResult(self.seqs, sampled, [])
        values = self.prompt_copy.wait() if self.prompt_copy is not None else self.picks.tail()
        return StepResult(self.seqs, sampled, unpack_prompt_logprobs(values, self.prompt))

    def pick_index(self) -> dict[int, int]:
        """id(sequence) -> index of its pick in picks.tokens (what the next step's rows are fed from)."""
        return {id(seq): i for i, seq in enumerate(self.seqs)}


@dataclass(frozen=True)
class ModelInput:
    """One step's batch: on the device for an eager forward, or on the host for a decode graph (`graph`)."""

    input_ids: torch.Tensor | None      # [T] (None with graph)
    positions: torch.Tensor | None      # [T]
    meta: AttentionMetadata | None
    sample_rows: torch.Tensor | None    # [S] batch rows whose next token is sampled (None with graph)
    host: HostBatch
    rows_in_order: bool                 # the sampled rows are rows 0..S-1: no gather before the LM head
    graph: DecodeBatch | None = None    # a decode-only step the captured graphs run
    sampling: StepSampling | None = None  # the sampled rows' plan, its uploads bound (None: nothing sampled)
    prompt: PromptPlan | None = None    # the prompt-logprob rows, in the same uploads
    uploads: Uploads | None = None      # the sampling's and the prompt rows' device inputs, bound


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler, device: torch.device,
                 attention: AttentionBackend | None = None,
                 step_sender: Callable[[StepInputs], None] | None = None, io: StepIO | None = None):
        """attention: the backend every layer uses (default: `auto` for this device and pool dtype).
        step_sender (tensor-parallel rank 0, TPLeader.send_step): gets each step's host inputs before the
        forward, for the other ranks to run the same one; None with one rank. io: the step's host <-> device
        copies (the sampler's copy back goes through the same one); a new StepIO if None."""
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.spec.block_size
        self.attention = attention or select_backend("auto", device, kv_cache.spec.dtype)
        self.decode_graphs: DecodeGraphs | None = None  # capture_graphs, once the pool exists (CUDA)
        self.mixed_graphs: MixedGraphs | None = None  # the same, for steps that hold prompt chunks
        self.io = io or StepIO(device)
        self.tables = DeviceBlockTables(64, device)
        self.host_tables = BlockTableMirrors()  # the step message of tensor-parallel rank 0 carries host tables
        self.step_sender = step_sender

    def capture_graphs(self, config: EngineConfig, max_model_len: int) -> None:
        """Capture the CUDA graphs that apply (decode_graphs_for, mixed_graphs_for: none on CPU): the decode
        forwards, then the pieces of prefill and mixed steps."""
        self.decode_graphs = decode_graphs_for(self.model, self.kv_cache, self.attention, config, max_model_len,
                                               self.device, self.io)
        self.mixed_graphs = mixed_graphs_for(self.model, self.kv_cache, self.attention, config, self.device)

    def close(self) -> None:
        """Let go of the model, the KV pool and the decode graphs (closed), so their memory can be freed once
        the engine drops its own references. The runner cannot execute afterwards. Idempotent."""
        for graphs in (self.decode_graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.close()
        self.decode_graphs = self.mixed_graphs = None
        self.model = self.kv_cache = self.tables = None

    def execute(self, chunks: list[ScheduledChunk], on_layer: Callable[[int], None] | None = None) -> StepResult:
        """launch(chunks, on_layer).result(): the step, its picks on the host."""
        return self.launch(chunks, on_layer).result()

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk], on_layer: Callable[[int], None] | None = None,
               fed_by: LaunchedStep | None = None) -> LaunchedStep:
        """Issue one forward over all chunks (writes their K/V into the pool) and the sampling of the rows that
        end a sequence's tokens (and of its forks); the prompt logprobs the chunks give are computed here. Does
        not change the sequences. on_layer: called for each layer once its K/V are stored (CausalLM.forward, or
        the pieces of mixed_graphs.py); a step with it never replays a decode graph. fed_by: the step still running
        whose picks are the pending last tokens of some of these sequences (async scheduling)."""
        batch = self.prepare(chunks, graphed=on_layer is None, fed_by=fed_by)
        fed = fed_by.picks.tokens if fed_by is not None and fed_by.picks is not None else None
        if batch.graph is not None:
            hidden, sample_rows = self.decode_graphs.run_staged(batch.graph, self.tables, fed)  # [B, hidden], [S]
        else:
            mixed = self.mixed_graphs
            forward = mixed.forward if mixed is not None and mixed.covers(len(batch.host.input_ids)) else self.model
            hidden = forward(batch.input_ids, batch.positions, batch.meta, self.kv_cache, on_layer)  # [T, hidden]
            sample_rows = batch.sample_rows
        prompt = None if batch.prompt is None else \
            prompt_logprob_tensors(self.model, hidden, batch.prompt, batch.uploads)  # [P * (2 + 2k)]
        seqs = batch.host.sampled
        if not seqs:
            return LaunchedStep((), None, batch.prompt, None if prompt is None else self.sampler.start_copy(prompt))
        picked = hidden[:len(seqs)] if batch.rows_in_order else hidden.index_select(0, sample_rows)  # [S, hidden]
        logits = self.model.compute_logits(picked)  # [S, vocab]
        picks = self.sampler.sample_planned(logits, batch.sampling, tail=prompt)  # the step's one copy back
        return LaunchedStep(tuple(seqs), picks, batch.prompt)

    def prepare(self, chunks: list[ScheduledChunk], graphed: bool = True,
                fed_by: LaunchedStep | None = None) -> ModelInput:
        """The step's flat batch (single-token chunks first) and its inputs, sent to the device in one upload:
        token ids, per-sequence counts, the block-table rows and their updates (engine/runner/device_tables.py),
        and behind them the sampling's inputs (Sampler.plan: fills grammar bitmasks, draws seeded uniforms) and the
        prompt-logprob rows. Positions and pool slots are computed on the device; a decode-only step a graph covers
        (and `graphed`) is left on the host for DecodeGraphs.run_staged (the sampling's inputs already written
        behind its fields). Python work is per sequence and per new block (and per prompt token for the ids)."""
        batch = host_batch(chunks, fed_by.pick_index() if fed_by is not None else {})
        seqs, computed, new = batch.seqs, batch.num_computed, batch.num_new
        width = table_width(batch.seq_lens, self.block_size)
        if self.step_sender is not None:
            if batch.feed_rows:
                raise RuntimeError("a tensor-parallel step cannot take its ids from the device (async scheduling)")
            tables = self.host_tables.tables(seqs, width)  # [N, width] int32
            self.step_sender(StepInputs(batch.input_ids, computed, new, tables, batch.sample_rows, batch.prompt.rows))
        table_rows, updates = self.tables.plan(seqs)
        uploads = Uploads()
        sampling = self._plan_sampling(batch, uploads)
        prompt = plan_prompt_logprobs(batch.prompt, uploads)
        in_order = batch.sample_rows == list(range(len(batch.sample_rows)))
        graphs = self.decode_graphs
        if graphed and graphs is not None and graphs.takes(len(seqs), len(batch.input_ids), len(batch.sample_rows)):
            if len(updates) > UPDATE_CAPACITY:  # more than the graphs' upload has room for: a copy of their own
                stage_eager(self.io, self.tables, HostBatch(), [], updates, uploads)
                updates = TableUpdates()
            elif len(uploads) and not self.decode_graphs.stage_behind(len(seqs), len(updates), uploads):
                stage_eager(self.io, self.tables, HostBatch(), [], TableUpdates(), uploads)
            slots = [s.block_table[c // self.block_size] * self.block_size + c % self.block_size
                     for s, c in zip(seqs, computed)]
            graph = DecodeBatch(batch.input_ids, computed, slots, table_rows, batch.sample_rows, updates,
                                batch.feed_rows, batch.feed_from)
            return ModelInput(None, None, None, None, batch, in_order, graph, sampling, prompt, uploads)
        view = stage_eager(self.io, self.tables, batch, table_rows, updates, uploads)
        fed = fed_by.picks.tokens if batch.feed_rows else None
        feed_tokens(view["input_ids"], view["feed_rows"], fed, view["feed_from"])
        counts = StepCounts(view["num_computed"], view["num_new"], view["query_start"], view["seq_lens"])
        step = step_tensors(self.attention, counts, self.tables.gather(view["table_rows"], width),
                            tuple(query_starts(new)), tuple(batch.seq_lens), self.block_size)
        return ModelInput(view["input_ids"], step.positions, step.meta, view["sample_rows"], batch, in_order, None,
                          sampling, prompt, uploads)

    def _plan_sampling(self, batch: HostBatch, uploads: Uploads) -> StepSampling | None:
        """The sampled rows' Sampler.plan (their inputs added to uploads); None when the step samples nothing."""
        seqs = batch.sampled
        if not seqs:
            return None
        return self.sampler.plan([s.params for s in seqs], batch.pick_positions,
                                 [(s.token_ids, s.num_prompt_tokens) for s in seqs], [s.grammar for s in seqs],
                                 self.model.config.vocab_size, uploads)
