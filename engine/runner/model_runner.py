"""ModelRunner: turns a step's scheduled chunks into one packed batch, runs it, samples.

Batch order: single-token chunks first (they share one batched attention call), then prefill chunks.
Only rows that finish a sequence's known tokens are sampled (logits skipping): the LM head never
sees the other prompt tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata, select_backend
from engine.attention.block_tables import BlockTableMirrors
from engine.attention.metadata import StepCounts, query_starts, step_tensors, table_width
from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.parallel.step_message import StepInputs
from engine.runner.decode_graphs import UPDATE_CAPACITY, DecodeBatch, DecodeGraphs
from engine.runner.device_tables import DeviceBlockTables, TableUpdates
from engine.runner.step_io import StepIO, layout
from engine.sampling.logprobs import TokenLogprobs
from engine.sampling.prompt_logprobs import PromptRows, compute_prompt_logprobs, prompt_rows
from engine.sampling.sampler import Sampler, SamplerOutput
from engine.sequence import ScheduledChunk, Sequence


@dataclass(frozen=True)
class StepResult:
    """What one forward gave: the sampled sequences with their picks, and prompt logprobs (sequence, entry)
    in prompt order."""

    seqs: tuple[Sequence, ...]
    sampled: SamplerOutput
    prompt_logprobs: list[tuple[Sequence, TokenLogprobs]]


@dataclass(frozen=True)
class ModelInput:
    """One step's batch: on the device for an eager forward, or on the host for a decode graph (`graph`)."""

    input_ids: torch.Tensor | None      # [T] (None with graph)
    positions: torch.Tensor | None      # [T]
    meta: AttentionMetadata | None
    sample_rows: torch.Tensor | None    # [S] batch rows whose next token is sampled (None with graph)
    sampled_seqs: tuple[Sequence, ...]
    prompt_rows: PromptRows             # rows whose logits give prompt logprobs (requests that ask)
    rows_in_order: bool                 # the sampled rows are rows 0..S-1: no gather before the LM head
    graph: DecodeBatch | None = None    # a decode-only step the captured graphs run


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
        self.decode_graphs: DecodeGraphs | None = None  # set by the engine once the pool exists (CUDA)
        self.io = io or StepIO(device)
        self.tables = DeviceBlockTables(64, device)
        self.host_tables = BlockTableMirrors()  # the step message of tensor-parallel rank 0 carries host tables
        self.step_sender = step_sender

    def close(self) -> None:
        """Let go of the model, the KV pool and the decode graphs (closed), so their memory can be freed once
        the engine drops its own references. The runner cannot execute afterwards. Idempotent."""
        if self.decode_graphs is not None:
            self.decode_graphs.close()
        self.decode_graphs = None
        self.model = self.kv_cache = self.tables = None

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], on_layer: Callable[[int], None] | None = None) -> StepResult:
        """Run one forward over all chunks (writes their K/V into the pool); returns the sampled
        sequences and, for each, one new token (and its logprobs if asked), and the prompt logprobs the
        chunks gave. Does not change the sequences themselves. on_layer: called for each layer of an eager
        forward once its K/V are stored (CausalLM.forward); a step with it never replays a graph."""
        batch = self.prepare(chunks, graphed=on_layer is None)
        if batch.graph is not None:
            hidden, sample_rows = self.decode_graphs.run_staged(batch.graph, self.tables)  # [B, hidden], [S]
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache, on_layer)  # [T, hidden]
            sample_rows = batch.sample_rows
        prompt_logprobs = compute_prompt_logprobs(self.model, hidden, batch.prompt_rows) \
            if batch.prompt_rows.rows else []
        seqs = batch.sampled_seqs
        if not seqs:
            return StepResult((), SamplerOutput([], []), prompt_logprobs)
        picked = hidden[:len(seqs)] if batch.rows_in_order else hidden.index_select(0, sample_rows)  # [S, hidden]
        logits = self.model.compute_logits(picked)  # [S, vocab]
        sampled = self.sampler.sample(logits, [s.params for s in seqs], [s.num_tokens for s in seqs],
                                      [(s.token_ids, s.num_prompt_tokens) for s in seqs],
                                      constraints=[s.grammar for s in seqs])
        return StepResult(seqs, sampled, prompt_logprobs)

    def prepare(self, chunks: list[ScheduledChunk], graphed: bool = True) -> ModelInput:
        """The step's flat batch (single-token chunks first) and its inputs, sent to the device in one upload:
        token ids, per-sequence counts, the block-table rows and their updates (engine/runner/device_tables.py).
        Positions and pool slots are computed on the device; a decode-only step a graph covers (and `graphed`)
        is left on the host for DecodeGraphs.run_staged. Python work is per sequence and per new block (and per
        prompt token for the ids)."""
        ordered = sorted(chunks, key=lambda c: c.num_new_tokens > 1)  # stable: single tokens first
        input_ids, sample_rows, sampled, row, prompt = [], [], [], 0, PromptRows([], [], [])
        for chunk in ordered:
            seq, start, n = chunk.seq, chunk.seq.num_computed_tokens, chunk.num_new_tokens
            input_ids += seq.token_ids[start:start + n]
            prompt_rows(seq, start, n, row, prompt)
            row += n
            if chunk.samples:  # the sequence's next token; a prefill of n samples gives each its first
                for sample in (seq, *seq.forks):
                    sample_rows.append(row - 1)
                    sampled.append(sample)
        seqs = [c.seq for c in ordered]
        computed, new = [s.num_computed_tokens for s in seqs], [c.num_new_tokens for c in ordered]
        width = table_width([c + n for c, n in zip(computed, new)], self.block_size)
        if self.step_sender is not None:
            tables = self.host_tables.tables(seqs, width)  # [N, width] int32
            self.step_sender(StepInputs(input_ids, computed, new, tables, sample_rows, prompt.rows))
        table_rows, updates = self.tables.plan(seqs)
        in_order = sample_rows == list(range(len(sample_rows)))
        graphs = self.decode_graphs
        if graphed and graphs is not None and len(input_ids) == len(seqs) >= len(sample_rows) \
                and graphs.covers(len(seqs)):
            if len(updates) > UPDATE_CAPACITY:  # more than the graphs' upload has room for: a copy of their own
                self._stage_eager([], [], [], [], [], updates)
                updates = TableUpdates()
            slots = [s.block_table[c // self.block_size] * self.block_size + c % self.block_size
                     for s, c in zip(seqs, computed)]
            graph = DecodeBatch(input_ids, computed, slots, table_rows, sample_rows, updates)
            return ModelInput(None, None, None, None, tuple(sampled), prompt, in_order, graph)
        view = self._stage_eager(input_ids, computed, new, table_rows, sample_rows, updates)
        counts = StepCounts(view["num_computed"], view["num_new"], view["query_start"], view["seq_lens"])
        step = step_tensors(self.attention, counts, self.tables.gather(view["table_rows"], width),
                            tuple(query_starts(new)), tuple(c + n for c, n in zip(computed, new)), self.block_size)
        return ModelInput(view["input_ids"], step.positions, step.meta, view["sample_rows"], tuple(sampled),
                          prompt, in_order)

    def _stage_eager(self, input_ids: list[int], computed: list[int], new: list[int], table_rows: list[int],
                     sample_rows: list[int], updates: TableUpdates) -> dict[str, torch.Tensor]:
        """The eager step's inputs through the staging buffer in one upload; applies the table updates. Returns
        the device views by field name."""
        num_seqs, num_updates = len(computed), len(updates)
        fields, end = layout([("input_ids", np.int64, len(input_ids)), ("num_computed", np.int64, num_seqs),
                              ("num_new", np.int64, num_seqs), ("query_start", np.int32, num_seqs + 1),
                              ("seq_lens", np.int32, num_seqs), ("table_rows", np.int64, num_seqs),
                              ("sample_rows", np.int64, len(sample_rows)), ("update_rows", np.int64, num_updates),
                              ("update_cols", np.int64, num_updates), ("update_blocks", np.int32, num_updates)])
        staging = self.io.staging_for(end)
        staging.wait_writable()
        host = {name: staging.host(f) for name, f in fields.items()}
        host["input_ids"][:], host["num_computed"][:], host["num_new"][:] = input_ids, computed, new
        host["query_start"][0] = 0
        np.cumsum(host["num_new"], out=host["query_start"][1:], dtype=np.int32)
        np.add(host["num_computed"], host["num_new"], out=host["seq_lens"], casting="unsafe")
        host["table_rows"][:], host["sample_rows"][:] = table_rows, sample_rows
        host["update_rows"][:], host["update_cols"][:], host["update_blocks"][:] = \
            updates.rows, updates.cols, updates.blocks
        staging.upload(end)
        view = {name: staging.device_view(f) for name, f in fields.items()}
        self.tables.apply(view["update_rows"], view["update_cols"], view["update_blocks"])
        return view


def run_forward(model: CausalLM, kv_cache: KVCache, graphs: DecodeGraphs | None, input_ids: torch.Tensor,
                positions: torch.Tensor, meta: AttentionMetadata,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
    """The model forward ([T] ids -> [T, hidden]), replayed from a captured graph when the step is decode rows
    only (no layer callbacks then: only prefill steps stream). Tensor-parallel followers run it too."""
    if graphs is not None and meta.num_decode_rows == meta.num_seqs and graphs.covers(meta.num_seqs) \
            and on_layer is None:
        return graphs.run(input_ids, positions, meta)
    return model(input_ids, positions, meta, kv_cache, on_layer)
