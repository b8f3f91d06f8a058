"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs): the logprob of every prompt token given the tokens
before it, and that many most likely alternatives, from the model's raw logits (log-softmax, no processors,
no temperature), as vLLM reports them. The first prompt token has none (None), as OpenAI's echo shows it.

They need the hidden state of every prompt position, so a request asking for them skips the prefix cache
(Scheduler) and its prefill chunks send those rows through the LM head beside the sampled ones, in slices
of ROWS_PER_SLICE to bound the [rows, vocab] logits. The rows and their targets cross in the step's one upload
(planned with the step: `plan_prompt_logprobs`), the results come back in its one copy, behind the picks.
Entries accumulate on the sequence chunk by chunk (`Sequence.prompt_logprobs`); a prompt recomputed after a
preemption does not add them twice.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.host_lists import Key, Uploads
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


@dataclass(frozen=True)
class PromptPlan:
    """A step's prompt-logprob rows, planned on the host: their rows and targets are Keys of the step's uploads."""

    wanted: PromptRows
    k: int      # the largest prompt_logprobs among the owners
    rows: Key   # [R] int64
    targets: Key  # [R] int64

    @property
    def width(self) -> int:
        """Values per row in prompt_logprob_tensors."""
        return 2 + 2 * self.k


def plan_prompt_logprobs(wanted: PromptRows, uploads: Uploads) -> PromptPlan | None:
    """The wanted rows and their targets added to uploads; None (nothing added) when there are none."""
    if not wanted.rows:
        return None
    k = max(owner.params.prompt_logprobs for owner in wanted.owners)
    return PromptPlan(wanted, k, uploads.add(wanted.rows, np.int64), uploads.add(wanted.targets, np.int64))


def prompt_logprob_tensors(model, hidden: torch.Tensor, plan: PromptPlan, uploads: Uploads) -> torch.Tensor:
    """The planned rows' prompt logprobs on the device, [R * (2 + 2k)] float64 (per row: the target's logprob, its
    rank, the top-k logprobs, the top-k ids), for one copy back with the step's picks. hidden: [T, hidden] of the
    step; the LM head runs on slices of ROWS_PER_SLICE rows (tensor-parallel followers make the same calls)."""
    all_rows, all_targets = uploads.get(plan.rows), uploads.get(plan.targets)  # [R], [R]
    parts = []
    for begin in range(0, len(plan.wanted.rows), ROWS_PER_SLICE):
        rows, targets = all_rows[begin:begin + ROWS_PER_SLICE], all_targets[begin:begin + ROWS_PER_SLICE]  # [r]
        logits = model.compute_logits(hidden.index_select(0, rows))  # [r, vocab] float32
        normalizer = logits.logsumexp(dim=-1, keepdim=True)  # [r, 1]
        target = logits.gather(1, targets.unsqueeze(1))  # [r, 1]
        rank = (logits > target).sum(dim=-1, keepdim=True, dtype=torch.int32) + 1  # [r, 1]
        top_values, top_ids = logits.topk(plan.k, dim=-1)  # [r, k]
        parts.append(torch.cat([(target - normalizer).double(), rank.double(), (top_values - normalizer).double(),
                                top_ids.double()], dim=1).flatten())  # [r * (2 + 2k)]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def unpack_prompt_logprobs(values: list[float], plan: PromptPlan) -> list[tuple[Sequence, TokenLogprobs]]:
    """The host copy of prompt_logprob_tensors -> (sequence, its next prompt token's TokenLogprobs) per row, in row
    order (so each sequence's in prompt order)."""
    out, k, width = [], plan.k, plan.width
    for n, (token, owner) in enumerate(zip(plan.wanted.targets, plan.wanted.owners)):
        row = values[n * width:(n + 1) * width]
        mine = owner.params.prompt_logprobs
        out.append((owner, TokenLogprobs(token, row[0], int(row[1]), tuple(int(t) for t in row[2 + k:2 + k + mine]),
                                         tuple(row[2:2 + mine]))))
    return out
