"""CUDA graphs for decode steps: the model forward of a decode-only batch, captured once per batch size.

After warm-up, the forward of 1, 2, 4, 8, ... up to max_num_seqs single-token rows is captured into CUDA
graphs that share one memory pool (largest first). Their static inputs (ids, positions, slots, context lengths)
are views of one staging buffer (engine/step_io.py): a decode-only step writes its rows on the host, padded
up to the next captured size, with the block-table updates behind them, and one upload lands everything where the
graph reads it; one scatter updates the device block table, one gather lays out the step's rows, and the graph
replays. Mixed steps run eager. Padding rows write their K/V to slot -1 (the Triton store skips it) and attend to
one token of a live row's first block, so a replay never writes a block anyone owns. The decode kernel's grid is
sized for max_model_len, so one graph serves every context length. The logits and the sampler run eager, after
the replay.

With capture=False (CPU, tests) the same static buffers and padding run eagerly: everything but the capture.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import EngineConfig
from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.runner.device_memory import garbage_collection_paused
from engine.runner.device_tables import DeviceBlockTables, TableUpdates
from engine.runner.step_batch import feed_tokens
from engine.host_lists import Uploads
from engine.step_io import Field, StepIO, layout, stage_uploads, uploads_layout

logger = logging.getLogger("tandem.engine")


def decode_graphs_for(model: CausalLM, kv_cache: KVCache, attention: AttentionBackend, config: EngineConfig,
                      max_model_len: int, device: torch.device, io: StepIO | None = None) -> "DecodeGraphs | None":
    """Captured decode graphs when they apply: on CUDA, without enforce_eager, with the triton backend. io: the
    runner's StepIO (DecodeGraphs)."""
    if device.type != "cuda" or config.enforce_eager or not attention.supports_decode_graphs:
        return None
    return DecodeGraphs(model, kv_cache, attention, config.max_num_seqs, max_model_len, device, io=io)


def _pad(host: dict[str, np.ndarray], rows: int, size: int, table_row: int) -> None:
    """Padding rows [rows, size): write their K/V nowhere (slot -1), attend to one token of a live row's table."""
    host["input_ids"][rows:size] = 0
    host["positions"][rows:size] = 0
    host["slots"][rows:size] = -1
    host["seq_lens"][rows:size] = 1
    host["table_rows"][rows:size] = table_row


def batch_size_ladder(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs itself."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return tuple(sizes + [max_num_seqs])


# Table updates one decode step may carry in the graphs' own upload; a step with more (a decode worker admitting
# many long prompts at once) sends its tables through the runner's eager buffer first: a second copy, that step.
UPDATE_CAPACITY = 4096


@dataclass(frozen=True)
class DecodeBatch:
    """A decode-only step on the host, one row per sequence (ModelRunner builds it)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]          # each row's pool slot for its new K/V
    table_rows: list[int]     # each row's row of the device block table
    sample_rows: list[int]    # batch rows sampled (all of them, but a prompt's non-final single token)
    updates: TableUpdates     # what the device block table needs first (DeviceBlockTables.plan)
    feed_rows: list[int]      # rows whose id is a pick of the step still running (async scheduling) ...
    feed_from: list[int]      # ... at this index of its picks


def staged_layout(size: int, num_updates: int = UPDATE_CAPACITY) -> tuple[dict[str, Field], int]:
    """The graphs' input fields for a batch padded to `size` rows, then room for num_updates table updates."""
    return layout([("input_ids", np.int64, size), ("positions", np.int64, size), ("slots", np.int64, size),
                   ("seq_lens", np.int32, size), ("table_rows", np.int64, size), ("sample_rows", np.int64, size),
                   ("feed_rows", np.int64, size), ("feed_from", np.int64, size),
                   ("update_rows", np.int64, num_updates), ("update_cols", np.int64, num_updates),
                   ("update_blocks", np.int32, num_updates)])


class DecodeGraphs:
    """Replays captured decode forwards; `covers(n)` says whether an n-row decode-only step can use one."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, attention: AttentionBackend, max_num_seqs: int,
                 max_model_len: int, device: torch.device, capture: bool = True, io: StepIO | None = None) -> None:
        """io: the runner's StepIO (the graphs' upload is counted with its copies); a StepIO of its own if None."""
        if not attention.supports_decode_graphs:
            raise ValueError(f"decode graphs need the triton attention backend, not {attention.name!r}")
        self.model, self.kv_cache, self.attention = model, kv_cache, attention
        self.sizes = batch_size_ladder(max_num_seqs)
        self.max_model_len, self.block_size = max_model_len, kv_cache.spec.block_size
        self.staging = (io or StepIO(device)).buffer(staged_layout(self.sizes[-1])[1])
        self.block_tables = torch.zeros(self.sizes[-1], -(-max_model_len // self.block_size), dtype=torch.int32,
                                        device=device)  # [M, max_blocks]: the step's rows gathered before a replay
        self.query_start = torch.arange(self.sizes[-1] + 1, dtype=torch.int32, device=device)  # one query a row
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def takes(self, num_rows: int, num_tokens: int, num_samples: int) -> bool:
        """Whether a step replays a graph: one token per row, no more sampled rows than rows, a captured size that
        covers them (rank 0 and its followers decide by this one rule)."""
        return num_tokens == num_rows >= num_samples and self.covers(num_rows)

    def covers(self, num_rows: int) -> bool:
        return self.staging is not None and 0 < num_rows <= self.sizes[-1]

    def close(self) -> None:
        """Drop the captured graphs (their memory pool with them), the static inputs and the references to the
        model and the pool; covers() is False from here on. Idempotent."""
        self._graphs.clear()
        self.staging = self.block_tables = None
        self.model = self.kv_cache = None

    @torch.inference_mode()
    def run_staged(self, batch: DecodeBatch, tables: DeviceBlockTables,
                   fed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden states [B, hidden] of a decode-only step of B = len(batch.input_ids) rows and the sampled rows
        [S] on the device: the batch goes across in one upload (with its table updates when they fit), the rows
        fed from the running step's picks `fed` take them, the device table is updated and its rows gathered,
        then the graph of the next size up replays. Writes the rows' K/V into the pool, exactly as the eager
        forward does."""
        rows, size = len(batch.input_ids), self._size_for(len(batch.input_ids))
        updates = batch.updates if len(batch.updates) <= UPDATE_CAPACITY else None
        fields, _ = staged_layout(size, len(updates) if updates is not None else 0)
        self.staging.wait_writable()
        host = {name: self.staging.host(f) for name, f in fields.items()}
        host["input_ids"][:rows], host["positions"][:rows] = batch.input_ids, batch.positions
        host["slots"][:rows], host["table_rows"][:rows] = batch.slots, batch.table_rows
        host["seq_lens"][:rows] = np.asarray(batch.positions) + 1
        host["sample_rows"][:len(batch.sample_rows)] = batch.sample_rows
        feeds = len(batch.feed_rows)
        host["feed_rows"][:feeds], host["feed_from"][:feeds] = batch.feed_rows, batch.feed_from
        _pad(host, rows, size, batch.table_rows[0])
        if updates is not None:
            host["update_rows"][:], host["update_cols"][:], host["update_blocks"][:] = \
                updates.rows, updates.cols, updates.blocks
        self.staging.upload(max(f.offset + f.nbytes for f in fields.values()))
        view = {name: self.staging.device_view(f) for name, f in fields.items()}
        feed_tokens(view["input_ids"], view["feed_rows"][:feeds], fed, view["feed_from"][:feeds])
        if updates is not None:
            tables.apply(view["update_rows"], view["update_cols"], view["update_blocks"])
        tables.gather(view["table_rows"], self.block_tables.shape[1], out=self.block_tables[:size])
        return self._replay(size)[:rows], view["sample_rows"][:len(batch.sample_rows)]

    def stage_behind(self, rows: int, num_updates: int, uploads: Uploads) -> bool:
        """Writes uploads behind the graphs' fields of a step of `rows` rows and num_updates table updates (binds
        their views), so run_staged's one upload carries them. False (nothing written) when they do not fit the
        graphs' buffer (engine/step_io.py APPENDED_ROOM): the caller stages them in a copy of their own."""
        _, used = staged_layout(self._size_for(rows), num_updates)
        fields, end = uploads_layout(uploads, used)
        if end > self.staging.capacity:
            return False
        self.staging.wait_writable()
        stage_uploads(self.staging, fields, uploads)
        self.staging.extend_next_upload(end)
        return True

    def _size_for(self, rows: int) -> int:
        return next(s for s in self.sizes if s >= rows)

    def _static(self, size: int) -> dict[str, torch.Tensor]:
        """The device views a graph of `size` rows reads (the same bytes the staged upload writes)."""
        fields, _ = staged_layout(size, 0)
        return {name: self.staging.device_view(f) for name, f in fields.items()}

    def _replay(self, size: int) -> torch.Tensor:
        if size in self._graphs:
            graph, hidden = self._graphs[size]
            graph.replay()
            return hidden
        return self._forward(size)

    def _forward(self, size: int) -> torch.Tensor:
        static = self._static(size)
        meta = AttentionMetadata(self.attention, static["slots"], self.query_start[:size + 1], static["seq_lens"],
                                 self.block_tables[:size], self.block_size, num_decode_rows=size,
                                 query_start_host=tuple(range(size + 1)), seq_lens_host=(self.max_model_len,) * size,
                                 decode_len_bound=self.max_model_len)
        return self.model(static["input_ids"], static["positions"], meta, self.kv_cache)

    def _capture_inputs(self, size: int) -> dict[str, torch.Tensor]:
        """The static inputs of a graph of `size` rows set to a harmless step before its warm-up and capture: token
        0 at position 0 in every row, K/V written nowhere (slot -1), one token attended through an all-zero table
        row. The device buffer holds whatever its memory held before (on CUDA, often a freed tensor's bytes): an
        id or position past the embedding or the rotary table fails the gather on the device."""
        static = self._static(size)
        for tensor in static.values():
            tensor.zero_()
        static["slots"].fill_(-1)
        static["seq_lens"].fill_(1)
        self.block_tables.zero_()
        return static

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_allocated()
        with garbage_collection_paused():
            for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
                self._capture_inputs(size)
                self._forward(size)  # warm-up: kernels compiled and autotuned outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self._forward(size)
                self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("decode graphs: captured batch sizes %s, graph memory %.1f MiB", list(self.sizes),
                    (torch.cuda.memory_allocated() - before) / (1 << 20))
