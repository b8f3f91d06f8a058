"""Logits processors: what changes a row's logits before the sampler picks, greedy rows included.

vLLM's semantics and order: `min_tokens` masks (-inf) EOS and the stop token ids while fewer than
min_tokens tokens were generated; `logit_bias` adds each biased token's bias; then the penalties:
repetition (every token of prompt + output: positive logits divided by it, negative ones multiplied),
frequency (minus penalty x the token's count in the output) and presence (minus penalty once the token
is in the output). "Output" is every token after the prompt, a resumed request's earlier tokens
included, so a migrated request is penalized as it would have been where it started.

All of it runs on the logits' device, vectorised over the rows that ask for something: one index_fill_
for the masks, one index_add_ for the biases, and for the penalties gathers and scatters at the flat
indexes (row x vocab + token) of the penalized rows' histories, so their cost grows with the histories,
not with rows x vocab. The host only flattens those histories (the prompt too for repetition) into one
list per kind. No row asking: nothing runs and the logits come back as they were. `cut_min_p` is the
min-p cut, applied by the sampler after temperature.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from engine.host_lists import row_values, to_device
from engine.sampling_params import SamplingParams

History = tuple[Sequence[int], int]  # (prompt + generated token ids so far, number of prompt tokens)


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   histories: Sequence[History] | None, eos_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """logits [S, vocab] float32 -> [S, vocab] after each row's min_tokens, logit_bias and penalties:
    the input itself (never written to) when no row asks for one, else a new tensor. histories[i]:
    row i's tokens (None: empty histories, so only logit_bias and a first token's min_tokens apply)."""
    rows_total, vocab = logits.shape
    histories = histories if histories is not None else [((), 0)] * rows_total
    banned = [_banned_now(p, h, eos_token_ids, vocab) for p, h in zip(params, histories)]
    rows = [i for i, p in enumerate(params) if banned[i] or p.logit_bias or p.penalized]
    if not rows:
        return logits
    index = to_device(rows, torch.long, logits.device)  # [P]
    picked = logits.index_select(0, index)  # [P, vocab], a copy: written in place below
    sub = [params[i] for i in rows]
    _mask(picked, [banned[i] for i in rows])
    _add_bias(picked, sub)
    penalized = [j for j, p in enumerate(sub) if p.penalized]
    if penalized:
        _penalize(picked, penalized, sub, [histories[rows[j]] for j in penalized])
    return picked if len(rows) == rows_total else logits.index_copy(0, index, picked)


def _banned_now(p: SamplingParams, history: History, eos_token_ids: Sequence[int], vocab: int) -> tuple[int, ...]:
    """The ids min_tokens masks for this row's next token: none once min_tokens were generated."""
    if p.min_tokens == 0 or len(history[0]) - history[1] >= p.min_tokens:
        return ()
    ids = p.stop_token_ids if p.ignore_eos else (*p.stop_token_ids, *eos_token_ids)
    return tuple(t for t in dict.fromkeys(ids) if t < vocab)


def _mask(logits: torch.Tensor, banned: list[tuple[int, ...]]) -> None:
    """-inf at each row's banned ids, in place; logits [P, vocab] contiguous (flat index_fill_: no sync)."""
    flat = [j * logits.shape[1] + t for j, ids in enumerate(banned) for t in ids]
    if flat:
        logits.view(-1).index_fill_(0, to_device(flat, torch.long, logits.device), float("-inf"))


def _add_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Adds each row's logit_bias, in place; logits [P, vocab] contiguous (ids checked against the
    vocabulary at admission; a flat index_add_: no sync)."""
    flat = [j * logits.shape[1] + t for j, p in enumerate(params) for t, _ in p.logit_bias]
    if flat:
        bias = to_device([b for p in params for _, b in p.logit_bias], logits.dtype, logits.device)  # [M]
        logits.view(-1).index_add_(0, to_device(flat, torch.long, logits.device), bias)


def _penalize(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
              histories: list[History]) -> None:
    """Repetition, frequency and presence penalties of `rows` of logits [P, vocab] (contiguous), in place,
    touching only the (row, token) entries the histories list: O(history), no [rows, vocab] temporary.
    Repetition and presence gather the entries' values, then scatter one new value per entry: a token
    listed several times gets the same value from each listing, so duplicates need no unique() (a sync on
    CUDA). Frequency adds -penalty once per listing in the output: -penalty x count."""
    vocab, device, flat = logits.shape[1], logits.device, logits.view(-1)
    sub = [params[j] for j in rows]
    prompt = _entries([h[0][:h[1]] if p.repetition_penalty != 1.0 else () for p, h in zip(sub, histories)],
                      rows, vocab, device)
    output = _entries([h[0][h[1]:] for h in histories], rows, vocab, device)
    listed = [e for e in (prompt, output) if e is not None]
    if listed and any(p.repetition_penalty != 1.0 for p in sub):
        keys, which = (torch.cat(parts) for parts in zip(*listed))  # [N], [N]
        repetition = to_device([p.repetition_penalty for p in sub], logits.dtype, device)[which]  # [N]
        values = flat.index_select(0, keys)  # [N]
        flat.scatter_(0, keys, torch.where(values > 0, values / repetition, values * repetition))
    if output is None:
        return
    keys, which = output  # [M], [M]: the generated tokens
    if any(p.frequency_penalty != 0.0 for p in sub):
        flat.index_add_(0, keys, -to_device([p.frequency_penalty for p in sub], logits.dtype, device)[which])
    if any(p.presence_penalty != 0.0 for p in sub):
        presence = to_device([p.presence_penalty for p in sub], logits.dtype, device)[which]  # [M]
        flat.scatter_(0, keys, flat.index_select(0, keys) - presence)


def _entries(slices: list[Sequence[int]], rows: list[int], vocab: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The flat logits index (row x vocab + token) of every token of slices[r] ([N]) and the r of each
    ([N]); None when the slices are empty. One flat list goes to the device; the rows are rebuilt there."""
    lengths = [len(s) for s in slices]
    total = sum(lengths)
    if total == 0:
        return None
    tokens = to_device(list(itertools.chain.from_iterable(slices)), torch.long, device)  # [N]
    which = torch.repeat_interleave(torch.arange(len(slices), device=device), to_device(lengths, torch.long, device),
                                    output_size=total)  # [N]
    return to_device(rows, torch.long, device)[which] * vocab + tokens, which


def cut_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """min_p on temperature-scaled logits [R, vocab] -> [R, vocab]: a token whose probability is below
    min_p x the top token's is set to -inf. p_i >= min_p x p_max  <=>  l_i >= l_max + log(min_p), so
    no softmax is needed. The input itself when no row has min_p."""
    if all(p.min_p == 0.0 for p in params):
        return logits
    floor = row_values([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], logits.dtype,
                       logits.device)  # shared, or [R, 1]
    top = logits.amax(dim=-1, keepdim=True)  # [R, 1]
    return logits.masked_fill(logits < top + floor, float("-inf"))  # [R, vocab]
