"""ModelRunner: turns a step's scheduled chunks into one packed batch, runs it, samples.

Batch order: single-token chunks first (they share one batched attention call), then prefill chunks.
Only rows that finish a sequence's known tokens are sampled (logits skipping): the LM head never
sees the other prompt tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import paged_decode_cpu
from engine.attention import AttentionMetadata, DecodeBatch, PrefillSpan
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.sampler import Sampler
from engine.scheduler import ScheduledChunk
from engine.sequence import Sequence


@dataclass(frozen=True)
class ModelInput:
    input_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor     # [S] batch rows whose next token is sampled
    sampled_seqs: tuple[Sequence, ...]


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.spec.block_size
        self.use_decode_kernel = paged_decode_cpu.supports(device, kv_cache.spec.dtype)
        if self.use_decode_kernel:
            paged_decode_cpu.compile_kernel()

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> tuple[tuple[Sequence, ...], list[int]]:
        """Run one forward over all chunks (writes their K/V into the pool); returns the sampled
        sequences and one new token for each. Does not change the sequences themselves."""
        batch = self.prepare(chunks)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache)  # [T, hidden]
        if not batch.sampled_seqs:
            return (), []
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))  # [S, vocab]
        seqs = batch.sampled_seqs
        tokens = self.sampler(logits, [s.params for s in seqs], [s.num_tokens for s in seqs])
        return seqs, tokens

    def prepare(self, chunks: list[ScheduledChunk]) -> ModelInput:
        """The step's flat batch: ids, positions, each token's pool slot and the attention metadata."""
        ordered = sorted(chunks, key=lambda c: c.num_new_tokens > 1)  # stable: single tokens first
        input_ids, positions, slots, sample_rows, sampled = [], [], [], [], []
        prefills, num_decode_rows, row = [], 0, 0
        for chunk in ordered:
            seq, start, n = chunk.seq, chunk.seq.num_computed_tokens, chunk.num_new_tokens
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slots += self._slots(seq.block_table, start, start + n)
            if n == 1:
                num_decode_rows += 1
            else:
                context = self._slot_tensor(seq.block_table, 0, start + n) if start else None
                prefills.append(PrefillSpan(row, row + n, start, context))
            if chunk.samples:
                sample_rows.append(row + n - 1)
                sampled.append(seq)
            row += n
        decode = self._decode_batch(ordered[:num_decode_rows]) if num_decode_rows else None
        meta = AttentionMetadata(self._tensor(slots), num_decode_rows, decode, tuple(prefills))
        return ModelInput(self._tensor(input_ids), self._tensor(positions), meta,
                          self._tensor(sample_rows), tuple(sampled))

    def _decode_batch(self, chunks: list[ScheduledChunk]) -> DecodeBatch:
        """Block tables and context lengths of the single-token rows (+ padded slots for torch)."""
        lengths = [c.seq.num_computed_tokens + 1 for c in chunks]
        max_blocks = -(-max(lengths) // self.block_size)
        tables = [_padded(c.seq.block_table[:max_blocks], max_blocks) for c in chunks]
        table = torch.tensor(tables, dtype=torch.long)  # [B, max_blocks]
        context_lens = torch.tensor(lengths, dtype=torch.long)
        if self.use_decode_kernel:
            return DecodeBatch(table, context_lens, self.block_size)
        slots = (table.unsqueeze(-1) * self.block_size + torch.arange(self.block_size)).view(len(chunks), -1)
        max_len = max(lengths)
        slots = slots[:, :max_len].contiguous()  # [B, L]
        mask = None
        if min(lengths) != max_len:
            mask = (torch.arange(max_len).unsqueeze(0) < context_lens.unsqueeze(1)).view(len(chunks), 1, 1, max_len)
            mask = mask.to(self.device)
        return DecodeBatch(table.to(self.device), context_lens.to(self.device), self.block_size,
                           slots.to(self.device), mask)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        size = self.block_size
        return [block_table[p // size] * size + p % size for p in range(start, end)]

    def _slot_tensor(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        return self._tensor(self._slots(block_table, start, end))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _padded(values: list[int], width: int) -> list[int]:
    return values + [0] * (width - len(values))
