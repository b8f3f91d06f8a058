"""ModelRunner: turns a step's scheduled chunks into one packed batch, runs it, samples.

Batch order: single-token chunks first (they share one batched attention call), then prefill chunks.
Only rows that finish a sequence's known tokens are sampled (logits skipping): the LM head never
sees the other prompt tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, AttentionMetadata, build_step_tensors, select_backend
from engine.attention.block_tables import BlockTableMirrors
from engine.attention.metadata import table_width
from engine.kv.kv_cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.parallel.step_message import StepInputs
from engine.runner.decode_graphs import DecodeGraphs
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
    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor     # [S] batch rows whose next token is sampled
    sampled_seqs: tuple[Sequence, ...]
    prompt_rows: PromptRows       # rows whose logits give prompt logprobs (requests that ask)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler, device: torch.device,
                 attention: AttentionBackend | None = None,
                 step_sender: Callable[[StepInputs], None] | None = None):
        """attention: the backend every layer uses (default: `auto` for this device and pool dtype).
        step_sender (tensor-parallel rank 0, TPLeader.send_step): gets each step's host inputs before the
        forward, for the other ranks to run the same one; None with one rank."""
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.spec.block_size
        self.attention = attention or select_backend("auto", device, kv_cache.spec.dtype)
        self.decode_graphs: DecodeGraphs | None = None  # set by the engine once the pool exists (CUDA)
        self.block_tables = BlockTableMirrors()
        self.step_sender = step_sender

    def close(self) -> None:
        """Let go of the model, the KV pool and the decode graphs (closed), so their memory can be freed once
        the engine drops its own references. The runner cannot execute afterwards. Idempotent."""
        if self.decode_graphs is not None:
            self.decode_graphs.close()
        self.decode_graphs = None
        self.model = self.kv_cache = None

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], on_layer: Callable[[int], None] | None = None) -> StepResult:
        """Run one forward over all chunks (writes their K/V into the pool); returns the sampled
        sequences and, for each, one new token (and its logprobs if asked), and the prompt logprobs the
        chunks gave. Does not change the sequences themselves. on_layer: called for each layer of an eager
        forward once its K/V are stored (CausalLM.forward)."""
        batch = self.prepare(chunks)
        hidden = self._forward(batch, on_layer)  # [T, hidden]
        prompt_logprobs = compute_prompt_logprobs(self.model, hidden, batch.prompt_rows) \
            if batch.prompt_rows.rows else []
        if not batch.sampled_seqs:
            return StepResult((), SamplerOutput([], []), prompt_logprobs)
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))  # [S, vocab]
        seqs = batch.sampled_seqs
        sampled = self.sampler.sample(logits, [s.params for s in seqs], [s.num_tokens for s in seqs],
                                      [(s.token_ids, s.num_prompt_tokens) for s in seqs],
                                      constraints=[s.grammar for s in seqs])
        return StepResult(seqs, sampled, prompt_logprobs)

    def _forward(self, batch: ModelInput, on_layer: Callable[[int], None] | None) -> torch.Tensor:
        return run_forward(self.model, self.kv_cache, self.decode_graphs, batch.input_ids, batch.positions,
                           batch.meta, on_layer)

    def prepare(self, chunks: list[ScheduledChunk]) -> ModelInput:
        """The step's flat batch: ids, positions, each token's pool slot and the attention metadata.
        Python work is per sequence (and per prompt token for the ids); slots are computed on the device."""
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
        computed, new = [c.seq.num_computed_tokens for c in ordered], [c.num_new_tokens for c in ordered]
        width = table_width([c + n for c, n in zip(computed, new)], self.block_size)
        tables = self.block_tables.tables([c.seq for c in ordered], width)  # [N, width] int32
        if self.step_sender is not None:
            self.step_sender(StepInputs(input_ids, computed, new, tables, sample_rows, prompt.rows))
        step = build_step_tensors(self.attention, computed, new, tables, self.block_size, self.device)
        return ModelInput(self._tensor(input_ids), step.positions, step.meta, self._tensor(sample_rows),
                          tuple(sampled), prompt)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def run_forward(model: CausalLM, kv_cache: KVCache, graphs: DecodeGraphs | None, input_ids: torch.Tensor,
                positions: torch.Tensor, meta: AttentionMetadata,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
    """The model forward ([T] ids -> [T, hidden]), replayed from a captured graph when the step is decode rows
    only (no layer callbacks then: only prefill steps stream). Tensor-parallel followers run it too."""
    if graphs is not None and meta.num_decode_rows == meta.num_seqs and graphs.covers(meta.num_seqs) \
            and on_layer is None:
        return graphs.run(input_ids, positions, meta)
    return model(input_ids, positions, meta, kv_cache, on_layer)
