"""CUDA graphs for decode steps: the model forward of a decode-only batch, captured once per batch size.

After warm-up, the forward of 1, 2, 4, 8, ... up to max_num_seqs single-token rows is captured into CUDA
graphs that share one memory pool (largest first). A step whose rows are all single-token queries copies
its inputs into the static buffers, pads up to the next captured size and replays; mixed steps run eager.
Padding rows write their K/V to slot -1 (the Triton store skips it) and attend to one token of block 0,
so a replay never touches a block anyone owns. The decode kernel's grid is sized for max_model_len, so one
graph serves every context length. The logits and the sampler run eager, after the replay.

With capture=False (CPU, tests) the same static buffers and padding run eagerly: everything but the capture.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import EngineConfig
from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM

logger = logging.getLogger("tandem.engine")


def decode_graphs_for(model: CausalLM, kv_cache: KVCache, attention: AttentionBackend, config: EngineConfig,
                      max_model_len: int, device: torch.device) -> "DecodeGraphs | None":
    """Captured decode graphs when they apply: on CUDA, without enforce_eager, with the triton backend."""
    if device.type != "cuda" or config.enforce_eager or not attention.supports_decode_graphs:
        return None
    return DecodeGraphs(model, kv_cache, attention, config.max_num_seqs, max_model_len, device)


def batch_size_ladder(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs itself."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return tuple(sizes + [max_num_seqs])


@dataclass
class _StaticInputs:
    """The buffers every captured graph reads; a replay sees whatever was copied into them last."""

    input_ids: torch.Tensor      # [M] int64
    positions: torch.Tensor      # [M] int64
    slot_mapping: torch.Tensor   # [M] int64, -1 on padding rows
    seq_lens: torch.Tensor       # [M] int32, 1 on padding rows
    block_tables: torch.Tensor   # [M, max_blocks] int32
    query_start: torch.Tensor    # [M + 1] int32, 0..M (one query per row)

    @classmethod
    def allocate(cls, max_rows: int, max_blocks: int, device: torch.device) -> "_StaticInputs":
        long = dict(dtype=torch.long, device=device)
        return cls(torch.zeros(max_rows, **long), torch.zeros(max_rows, **long),
                   torch.full((max_rows,), -1, **long),
                   torch.ones(max_rows, dtype=torch.int32, device=device),
                   torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device),
                   torch.arange(max_rows + 1, dtype=torch.int32, device=device))


class DecodeGraphs:
    """Replays captured decode forwards; `covers(n)` says whether an n-row decode-only step can use one."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, attention: AttentionBackend, max_num_seqs: int,
                 max_model_len: int, device: torch.device, capture: bool = True) -> None:
        if not attention.supports_decode_graphs:
            raise ValueError(f"decode graphs need the triton attention backend, not {attention.name!r}")
        self.model, self.kv_cache, self.attention = model, kv_cache, attention
        self.sizes = batch_size_ladder(max_num_seqs)
        self.max_model_len, self.block_size = max_model_len, kv_cache.spec.block_size
        max_blocks = -(-max_model_len // self.block_size)
        self.static = _StaticInputs.allocate(self.sizes[-1], max_blocks, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def covers(self, num_rows: int) -> bool:
        return self.static is not None and 0 < num_rows <= self.sizes[-1]

    def close(self) -> None:
        """Drop the captured graphs (their memory pool with them), the static inputs and the references to the
        model and the pool; covers() is False from here on. Idempotent."""
        self._graphs.clear()
        self.static = None
        self.model = self.kv_cache = None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states [B, hidden] of a decode-only step (meta.num_decode_rows == meta.num_seqs == B).
        Writes the rows' K/V into the pool, exactly as the eager forward does."""
        rows = meta.num_seqs
        size = next(s for s in self.sizes if s >= rows)
        self._load(input_ids, positions, meta, rows, size)
        if size in self._graphs:
            graph, hidden = self._graphs[size]
            graph.replay()
            return hidden[:rows]
        return self._forward(size)[:rows]

    def _load(self, input_ids, positions, meta: AttentionMetadata, rows: int, size: int) -> None:
        static = self.static
        width = meta.block_tables.shape[1]
        static.input_ids[:rows].copy_(input_ids)
        static.positions[:rows].copy_(positions)
        static.slot_mapping[:rows].copy_(meta.slot_mapping)
        static.seq_lens[:rows].copy_(meta.seq_lens)
        static.block_tables[:rows, :width].copy_(meta.block_tables)
        static.slot_mapping[rows:size].fill_(-1)  # padding rows: write nothing, attend to one token
        static.seq_lens[rows:size].fill_(1)

    def _forward(self, size: int) -> torch.Tensor:
        static = self.static
        meta = AttentionMetadata(self.attention, static.slot_mapping[:size], static.query_start[:size + 1],
                                 static.seq_lens[:size], static.block_tables[:size], self.block_size,
                                 num_decode_rows=size, query_start_host=tuple(range(size + 1)),
                                 seq_lens_host=(self.max_model_len,) * size, decode_len_bound=self.max_model_len)
        return self.model(static.input_ids[:size], static.positions[:size], meta, self.kv_cache)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_allocated()
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
            self.static.slot_mapping[:size].fill_(-1)
            self._forward(size)  # warm-up: kernels compiled and autotuned outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size)
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("decode graphs: captured batch sizes %s, graph memory %.1f MiB", list(self.sizes),
                    (torch.cuda.memory_allocated() - before) / (1 << 20))
