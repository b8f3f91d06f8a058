"""CUDA graphs for the steps that hold prompt chunks: the forward's pieces captured per token count.

Decode-only steps replay whole-forward graphs (decode_graphs.py). A step that holds a prompt chunk (a prefill or
a mixed step) ran eager, and on a GPU its launches, some 15-40 per layer, cost more host time than the device
spends on them. MixedGraphs captures each piece of the forward (engine/model/pieces.py: everything between two
attention calls) for each size of a ladder of token counts (token_buckets) at start. A step of T tokens, T at
most the largest size, is padded to the next size up; its ids, positions and slots are copied into the pieces'
buffers (the padding rows write their K/V nowhere: slot -1); then piece 0 replays, layer 0 attends eager, piece 1
replays, and so on. The attention stays eager because how it launches depends on the step's sequences (their
lengths, block tables, the prefill kernel's grid).

capture=False (CPU, tests): the same buffers, padding and pieces, run eager: everything but the capture.
After capturing, each size's replays are checked against its eager pieces on random inputs; a capture that raises
or a size that differs leaves those steps eager, logged, rather than wrong.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import EngineConfig
from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.model.pieces import ForwardPieces, PieceBuffers
from engine.runner.device_memory import garbage_collection_paused

logger = logging.getLogger("tandem.engine")
SMALLEST_SIZE = 16


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The token counts graphs are captured for: 16, 32, 48, ... each a quarter above the last (rounded up to
    16), then max_tokens: a step is padded by at most a quarter of its size (and at most 15 tokens below 64)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes, size = [], SMALLEST_SIZE
    while size < max_tokens:
        sizes.append(size)
        size = -(-(size + max(SMALLEST_SIZE, size // 4)) // SMALLEST_SIZE) * SMALLEST_SIZE
    return tuple(sizes + [max_tokens])


def mixed_graphs_apply(model: CausalLM, attention: AttentionBackend, config: EngineConfig,
                       device: torch.device) -> bool:
    """Whether an engine captures graphs of its prefill and mixed steps: on CUDA, without enforce_eager, with the
    triton backend, one rank, mixed_graph_max_tokens > 0."""
    return device.type == "cuda" and not config.enforce_eager and attention.supports_decode_graphs \
        and model.shard is None and config.mixed_graph_max_tokens > 0


def mixed_graphs_for(model: CausalLM, kv_cache: KVCache, attention: AttentionBackend, config: EngineConfig,
                     device: torch.device) -> "MixedGraphs | None":
    """Captured graphs of prefill and mixed steps when they apply (mixed_graphs_apply), else None."""
    if not mixed_graphs_apply(model, attention, config, device):
        return None
    max_tokens = min(config.mixed_graph_max_tokens, config.max_num_batched_tokens)
    return MixedGraphs(model, kv_cache, attention, max_tokens, device)


class MixedGraphs:
    """Runs steps of up to max_tokens tokens piece by piece: replayed graphs (or eager pieces with capture=False)
    with the attention eager between them. forward() takes CausalLM.forward's arguments and gives its result."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, attention: AttentionBackend, max_tokens: int,
                 device: torch.device, capture: bool = True) -> None:
        self.sizes = token_buckets(max_tokens)
        self.buffers = PieceBuffers.allocate(model, self.sizes[-1], device)
        self.pieces: ForwardPieces | None = ForwardPieces(model, kv_cache, attention.fused_layers, self.buffers)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        if capture:
            self._capture_all(device)

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def covers(self, num_tokens: int) -> bool:
        return self.pieces is not None and 0 < num_tokens <= self.sizes[-1]

    def close(self) -> None:
        """Drop the graphs (their pool with them) and the buffers; covers() is False from here on. Idempotent."""
        self._graphs.clear()
        self.pieces = self.buffers = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """CausalLM.forward of a step of T <= max_tokens tokens (input_ids, positions: [T]; kv_cache: the pool
        the pieces were built over): writes the step's K/V into the pool and returns the hidden states [T,
        hidden], a view of a static buffer that the next step overwrites. on_layer(i) runs once layer i's K/V
        are stored (its attention issued), as in CausalLM.forward."""
        pieces, tokens = self.pieces, input_ids.shape[0]
        if kv_cache is not pieces.kv_cache:
            raise ValueError("MixedGraphs.forward: not the KV pool its pieces were built over")
        size = next(s for s in self.sizes if s >= tokens)
        pieces.stage(input_ids, positions, meta.slot_mapping, size)
        graphs = self._graphs.get(size)
        for index in range(pieces.num_pieces):
            if graphs is not None:
                graphs[index].replay()
            else:
                pieces.run_piece(index, size)
            if index < pieces.num_pieces - 1:
                pieces.attend(index, meta)
                if on_layer is not None:
                    on_layer(index)
        return self.buffers.hidden[:tokens]

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_allocated(device)
        try:
            with garbage_collection_paused():
                for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
                    self._graphs[size] = self._capture(size, pool)
            differ = [size for size in self.sizes if not self._replays_match(size, device)]
        except Exception as exc:  # noqa: BLE001 - the steps run eager instead; the engine stays usable
            logger.warning("mixed-step graphs: capture failed, prefill and mixed steps run eager: %r", exc)
            self._graphs.clear()
            return
        if differ:
            logger.warning("mixed-step graphs: replays of sizes %s differ from their eager pieces: those steps "
                           "run eager", differ)
            for size in differ:
                del self._graphs[size]
        logger.info("mixed-step graphs: %d pieces captured for token counts %s, graph memory %.1f MiB",
                    self.pieces.num_pieces, list(self.captured_sizes),
                    (torch.cuda.memory_allocated(device) - before) / (1 << 20))

    def _capture(self, size: int, pool) -> list[torch.cuda.CUDAGraph]:
        """Every piece of `size` tokens: run once eager (kernels compiled and tuned outside the capture), then
        captured, over harmless inputs (token 0 at position 0, K/V written nowhere)."""
        empty = torch.zeros(0, dtype=torch.int64, device=self.buffers.input_ids.device)
        self.pieces.stage(empty, empty, empty, size)
        for index in range(self.pieces.num_pieces):
            self.pieces.run_piece(index, size)
        torch.cuda.synchronize()
        graphs = []
        for index in range(self.pieces.num_pieces):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.pieces.run_piece(index, size)
            graphs.append(graph)
        return graphs

    def _replays_match(self, size: int, device: torch.device) -> bool:
        """Whether the graphs of `size` give what their eager pieces give, on random ids, positions and attention
        outputs (no attention runs in between, so both see the same; K/V written nowhere)."""
        pieces, b = self.pieces, self.buffers
        generator = torch.Generator(device).manual_seed(size)
        ids = torch.randint(0, pieces.model.config.vocab_size, (size,), device=device, generator=generator)
        positions = torch.randint(0, pieces.model.rotary.cos.shape[0], (size,), device=device, generator=generator)
        b.attn[:size].normal_(generator=generator)
        pieces.stage(ids, positions, torch.full_like(ids, -1), size)
        for index in range(pieces.num_pieces):
            pieces.run_piece(index, size)
        expected = b.hidden[:size].float().clone()  # [size, hidden]
        for graph in self._graphs[size]:
            graph.replay()
        got = b.hidden[:size].float()
        scale = expected.abs().nan_to_num().max().item() or 1.0
        return bool(torch.allclose(got, expected, rtol=0.02, atol=0.02 * scale, equal_nan=True))
