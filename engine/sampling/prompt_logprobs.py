"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs): the logprob of every prompt token given the tokens
before it, and that many most likely alternatives, from the model's raw logits (log-softmax, no processors,
no temperature), as vLLM reports them. The first prompt token has none (None), as OpenAI's echo shows it.

They need the hidden state of every prompt position, so a request asking for them skips the prefix cache
(Scheduler) and its prefill chunks send those rows through the LM head beside the sampled ones, in slices
of ROWS_PER_SLICE to bound the [rows, vocab] logits. Entries accumulate on the sequence chunk by chunk
(`Sequence.prompt_logprobs`); a prompt recomputed after a preemption does not add them twice.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling.logprobs import TokenLogprobs
from engine.sequence import Sequence

ROWS_PER_SLICE = 512


@dataclass(frozen=True)
class PromptRows:
    """The batch rows whose logits give prompt logprobs: row i (the token at some position p) predicts
    targets[i] (the prompt token at p + 1) for sequence owners[i]."""

    rows: list[int]
    targets: list[int]
    owners: list[Sequence]


def prompt_rows(seq: Sequence, start: int, num_new: int, first_row: int, into: PromptRows) -> None:
    """Adds the rows of one chunk (`num_new` tokens of `seq` from position `start`, at batch rows from
    `first_row`) whose prompt logprob `seq` still lacks."""
    if seq.prompt_logprobs is None:
        return
    first = max(start, len(seq.prompt_logprobs) - 1)  # entry p + 1 comes from position p
    for position in range(first, min(start + num_new, seq.num_prompt_tokens - 1)):
        into.rows.append(first_row + position - start)
        into.targets.append(seq.token_ids[position + 1])
        into.owners.append(seq)


def compute_prompt_logprobs(model, hidden: torch.Tensor, wanted: PromptRows) -> list[tuple[Sequence, TokenLogprobs]]:
    """(sequence, its next prompt token's TokenLogprobs) per wanted row, in row order (so each sequence's in
    prompt order). hidden: [T, hidden] of the step; one host copy per slice."""
    k = max(owner.params.prompt_logprobs for owner in wanted.owners)
    out = []
    for begin in range(0, len(wanted.rows), ROWS_PER_SLICE):
        end = min(begin + ROWS_PER_SLICE, len(wanted.rows))
        rows = torch.tensor(wanted.rows[begin:end], dtype=torch.long, device=hidden.device)  # [R]
        targets = torch.tensor(wanted.targets[begin:end], dtype=torch.long, device=hidden.device)  # [R]
        logits = model.compute_logits(hidden.index_select(0, rows))  # [R, vocab] float32
        normalizer = logits.logsumexp(dim=-1, keepdim=True)  # [R, 1]
        target = logits.gather(1, targets.unsqueeze(1))  # [R, 1]
        rank = (logits > target).sum(dim=-1, keepdim=True, dtype=torch.int32) + 1  # [R, 1]
        top_values, top_ids = logits.topk(k, dim=-1)  # [R, k]
        packed = torch.cat([(target - normalizer).double(), rank.double(), (top_values - normalizer).double(),
                            top_ids.double()], dim=1).tolist()  # [R, 2 + 2k] on the host
        for row, token, owner in zip(packed, wanted.targets[begin:end], wanted.owners[begin:end]):
            mine = owner.params.prompt_logprobs
            out.append((owner, TokenLogprobs(token, row[0], int(row[1]),
                                             tuple(int(t) for t in row[2 + k:2 + k + mine]), tuple(row[2:2 + mine]))))
    return out
