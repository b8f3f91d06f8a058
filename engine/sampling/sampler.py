"""Sampler: one next token per sampled row, greedy or temperature / min-p / top-k / top-p, seedable per
request, with the row's logprobs when it asks.

On the logits' device (CPU or CUDA), vectorised over rows. First the token masks of rows under a grammar
(structured outputs: engine/sampling/token_mask.py; no such row, no mask work), then `process_logits`
(engine/sampling/logits_processors.py: min_tokens, logit_bias, penalties) on the rows that ask for any, greedy rows
included (it changes their argmax); no row asking, nothing runs. Greedy rows are then an argmax; the
others go through `transform_logits` (temperature), `cut_min_p`, then `candidate_probs`: no cut is a
softmax, nothing sorted; top-k is a `torch.topk` partial sort of the largest k asked for (each row masks
past its own k), top-p then cut within those candidates; top-p without top-k takes each row's top tokens
by a ladder of partial sorts that stops where they hold the nucleus, a full sort only past the ladder and
on a GPU (engine/sampling/nucleus.py). The draw is an inverse CDF, one uniform per row, in two
levels (block sums, then a cumsum inside the chosen block). Rows asking for logprobs get
`engine.sampling.logprobs.logprob_tensors` (log_softmax of the processed logits after temperature, before the
cuts) beside the draw. The host only builds small index / parameter tensors (non-blocking copies) and
per-row generators; the one device-to-host copy is the final `to_host` in `Sampler.sample`, which
brings the tokens and the small [L, 2 + 2k] logprob tensor back in one copy.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.host_lists import HostCopy, row_values
from engine.host_lists import to_device as _to_device
from engine.sampling.logits_processors import History, cut_min_p, process_logits
from engine.sampling.logprobs import TokenLogprobs, logprob_tensors, unpack
from engine.sampling.nucleus import nucleus_candidates
from engine.sampling.token_mask import TokenMaskFiller, apply_token_masks
from engine.sampling_params import SamplingParams

_BLOCK = 1024  # columns per block in the two-level argmax and draw


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw for the token at `position` (its index in the
    sequence, prompt included): a function of (seed, position) alone, the same in every process."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class SamplerOutput:
    """One step's picks: a token per row, and per row its TokenLogprobs (None where not asked)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass(frozen=True)
class DevicePicks:
    """One step's picks on the device (Sampler.sample_on_device), with their copy to the host under way."""

    tokens: torch.Tensor                # [S] int64, on the logits' device
    host: HostCopy                      # the tokens (then the packed logprobs of the rows that asked)
    params: tuple[SamplingParams, ...]
    asked: tuple[int, ...]              # rows that asked for logprobs

    def result(self) -> SamplerOutput:
        """The picks on the host (waits for the copy)."""
        values = self.host.wait()
        if not self.asked:
            return SamplerOutput(values, [None] * len(self.params))
        picks = [int(t) for t in values[:len(self.params)]]
        return SamplerOutput(picks, unpack(values[len(self.params):], picks, self.params, list(self.asked)))


class Sampler:
    """Picks tokens from logits. A seeded row draws its uniform from a generator on the logits' device
    seeded from (seed, position), so a seeded request gets the same tokens whatever shares its batch
    and whichever engine samples which of its tokens; unseeded rows share the sampler's generator for
    that device (one per device, created on first use, each seeded with `seed`). eos_token_ids: what
    min_tokens masks besides a request's stop_token_ids (unless it ignores EOS). mask_filler: what fills the
    bitmask of rows under a grammar (set by the engine at its first structured request). start_copy: how the picks
    start back to the host (engine/runner/step_io.py StepIO.start_to_host: one counted copy); a plain `tolist`
    at wait() if None."""

    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = (),
                 mask_filler: TokenMaskFiller | None = None,
                 start_copy: Callable[[torch.Tensor], HostCopy] | None = None) -> None:
        self.seed = seed
        self.eos_token_ids = tuple(eos_token_ids)
        self.mask_filler = mask_filler
        self.start_copy = start_copy or (lambda values: HostCopy(values, values.numel(), None))
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                 histories: Sequence[History] | None = None) -> list[int]:
        """The tokens of `sample`."""
        return self.sample(logits, params, positions, histories).tokens

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
               histories: Sequence[History] | None = None,
               constraints: Sequence[object | None] | None = None) -> SamplerOutput:
        """One token per row of logits [S, vocab]; positions[i] is the index the new token of row i will
        have; histories[i] = (row i's prompt + generated ids, its prompt length), read only by rows with
        penalties or an unmet min_tokens (None: empty histories); constraints[i]: row i's grammar state
        (engine/structured/ SequenceGrammar) or None; a constrained row picks only tokens its grammar allows,
        and its logprobs are those of the masked distribution. Reads the grammar states, never advances them."""
        return self.sample_on_device(logits, params, positions, histories, constraints).result()

    def sample_on_device(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int],
                         histories: Sequence[History] | None = None,
                         constraints: Sequence[object | None] | None = None) -> "DevicePicks":
        """`sample`, stopping once the picks are on the device and their copy to the host has started: the
        picks can feed the next step's forward (async scheduling) before the host has them."""
        logits = apply_token_masks(logits, constraints, self.mask_filler)  # [S, vocab]
        logits = process_logits(logits, params, histories, self.eos_token_ids)  # [S, vocab]
        tokens = _argmax(logits)  # [S] int64: the greedy pick, and the fallback of every row
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            every_row = len(rows) == logits.shape[0]
            index = None if every_row else _to_device(rows, torch.long, logits.device)  # [R]
            row_params = [params[i] for i in rows]
            picked = logits if every_row else logits.index_select(0, index)
            scaled = cut_min_p(transform_logits(picked.float(), row_params), row_params)  # [R, vocab]
            uniforms = self._uniforms(row_params, [positions[i] for i in rows], logits.device)  # [R]
            drawn = sample_rows(scaled, row_params, uniforms)  # [R], -1 where a row has no mass
            fallback = tokens if every_row else tokens.index_select(0, index)  # [R]
            drawn = torch.where(drawn >= 0, drawn, fallback)  # [R]
            tokens = drawn if every_row else tokens.index_copy(0, index, drawn)
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not asked:
            return DevicePicks(tokens, self.start_copy(tokens), tuple(params), ())  # the one device-to-host copy
        packed = logprob_tensors(logits, tokens, params, asked)  # [L, 2 + 2k] float64
        host = self.start_copy(torch.cat([tokens.double(), packed.flatten()]))  # the one device-to-host copy
        return DevicePicks(tokens, host, tuple(params), tuple(asked))

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def _uniforms(self, params: Sequence[SamplingParams], positions: Sequence[int],
                  device: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per row: seeded rows from their own (seed, position) generator,
        the others from the shared one, in row order."""
        num_shared = sum(p.seed is None for p in params)
        shared = torch.rand(num_shared, generator=self._generator(device), device=device)  # [U]
        parts, next_shared = [], 0
        for p, position in zip(params, positions):
            if p.seed is None:
                parts.append(shared[next_shared:next_shared + 1])
                next_shared += 1
            else:
                generator = torch.Generator(device=device).manual_seed(position_seed(p.seed, position))
                parts.append(torch.rand(1, generator=generator, device=device))
        return torch.cat(parts)  # [R]


def transform_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The per-row transform between the logits processors and the cuts: temperature. logits: [R, vocab]
    float32 of non-greedy rows -> [R, vocab], the input itself (never written to) when every
    temperature is 1."""
    if all(p.temperature == 1.0 for p in params):
        return logits
    temperature = row_values([p.temperature for p in params], logits.dtype, logits.device)  # shared, or [R, 1]
    return logits / temperature  # [R, vocab]


def _row_groups(params: Sequence[SamplingParams], vocab: int) -> list[list[int]]:
    """Rows by the work their cuts need: top-k (partial sort), top-p alone (engine/sampling/nucleus.py), no cut."""
    top_k = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    top_p = [i for i, p in enumerate(params) if not 0 < p.top_k < vocab and p.top_p < 1.0]
    plain = [i for i, p in enumerate(params) if not 0 < p.top_k < vocab and p.top_p >= 1.0]
    return [group for group in (top_k, top_p, plain) if group]


def candidate_probs(logits: torch.Tensor, params: Sequence[SamplingParams]):
    """Top-k, then top-p, on transformed logits [R, vocab]; correct for any mix of rows, fastest when
    they share a group of `_row_groups`. Returns (probs [R, n], ids [R, n]), probs normalised over each
    row's kept tokens and zero elsewhere, ids the vocabulary id of each column; ids is None when no row
    asks for a cut (then n == vocab, columns are token ids, and nothing was sorted)."""
    vocab, device = logits.shape[-1], logits.device
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if max(ks) < vocab:
        values, ids = logits.topk(max(ks), dim=-1)  # [R, k] high to low: a partial sort
        rank = torch.arange(values.shape[-1], device=device).unsqueeze(0)  # [1, k]
        k = row_values(ks, torch.long, device)  # shared, or [R, 1]
        probs = values.masked_fill(rank >= k, float("-inf")).softmax(dim=-1)  # [R, k]
    elif min(top_p) < 1.0:
        probs, ids = nucleus_candidates(logits, top_p)  # [R, n] high to low, enough to hold each nucleus
        rank = torch.arange(probs.shape[-1], device=device).unsqueeze(0)  # [1, n]
    else:
        return logits.softmax(dim=-1), None  # [R, vocab]
    if min(top_p) < 1.0:
        p = row_values(top_p, probs.dtype, device)  # shared, or [R, 1]
        mass_before = probs.cumsum(dim=-1) - probs  # [R, n]: mass of the higher-ranked tokens
        probs = probs.masked_fill((mass_before >= p) & (p < 1.0) & (rank > 0), 0.0)  # the top one stays
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, ids


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution the sampler draws from: raw logits [R, vocab] of non-greedy rows -> [R, vocab]
    probabilities (zero outside each row's min-p / top-k / top-p set; no logits processors: `logits`
    are taken as processed). For tests and inspection."""
    logits = cut_min_p(transform_logits(logits.float(), params), params)  # [R, vocab]
    out = torch.zeros_like(logits)  # [R, vocab]
    for group in _row_groups(params, logits.shape[-1]):
        index = _to_device(group, torch.long, logits.device)  # [G]
        probs, ids = candidate_probs(logits.index_select(0, index), [params[i] for i in group])
        dense = probs if ids is None else torch.zeros_like(out[: len(group)]).scatter_(1, ids, probs)
        out.index_copy_(0, index, dense)
    return out


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                uniforms: torch.Tensor) -> torch.Tensor:
    """One token id per row of transformed logits [R, vocab], drawn with uniforms [R]; -1 for a row
    whose kept probabilities do not sum to a positive finite mass (all -inf, NaN)."""
    groups = _row_groups(params, logits.shape[-1])
    if len(groups) == 1:
        return _draw(*candidate_probs(logits, params), uniforms)
    drawn = torch.empty_like(uniforms, dtype=torch.long)  # [R]
    for group in groups:
        index = _to_device(group, torch.long, logits.device)  # [G]
        probs, ids = candidate_probs(logits.index_select(0, index), [params[i] for i in group])
        drawn.index_copy_(0, index, _draw(probs, ids, uniforms.index_select(0, index)))
    return drawn


def _draw(probs: torch.Tensor, ids: torch.Tensor | None, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in two levels: the block whose cumulative mass passes u * total, then the column
    inside it, so a long row costs a summing pass, not a full cumsum. probs [R, n] >= 0, ids [R, n] or
    None (columns are token ids), uniforms [R] in [0, 1) -> token ids [R], -1 where there is no mass."""
    block_mass = _per_block(probs, lambda blocks: blocks.sum(dim=-1))  # [R, nb]
    block_cdf = block_mass.cumsum(dim=-1)  # [R, nb], non-decreasing
    total = block_cdf[:, -1:]  # [R, 1]
    target = _below(uniforms.unsqueeze(1) * total, total)  # [R, 1]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[-1] - 1)  # [R, 1]
    before = torch.nn.functional.pad(block_cdf, (1, 0)).gather(1, block)  # [R, 1]: earlier blocks' mass
    values, columns = _block_columns(probs, block, 0.0)  # [R, B]
    inner = values.cumsum(dim=-1)  # [R, B]
    residual = _below((target - before).clamp_(min=0.0), inner[:, -1:])  # [R, 1]
    inside = torch.searchsorted(inner, residual, right=True).clamp_(max=_BLOCK - 1)  # [R, 1]
    column = columns.gather(1, inside).clamp_(max=probs.shape[-1] - 1)  # [R, 1], in range even for NaN
    token = column if ids is None else ids.gather(1, column)  # [R, 1]
    valid = (total > 0) & torch.isfinite(total)  # [R, 1]
    return torch.where(valid, token, -1).squeeze(1)  # [R]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, n] -> [S], the first maximum of each row as torch.argmax gives it, in two levels
    (block maxima, then inside the first best block): a fraction of argmax's time on CPU."""
    block = _per_block(logits, lambda blocks: blocks.amax(dim=-1)).argmax(dim=-1, keepdim=True)  # [S, 1]
    values, columns = _block_columns(logits, block, float("-inf"))  # [S, B]
    return columns.gather(1, values.argmax(dim=-1, keepdim=True)).squeeze(1)  # [S]


def _per_block(x: torch.Tensor, reduce) -> torch.Tensor:
    """x [R, n] -> [R, nb]: reduce(blocks [R, m, B]) over runs of _BLOCK columns, the last run short."""
    rows, n = x.shape
    full = n // _BLOCK * _BLOCK
    parts = [reduce(x[:, :full].reshape(rows, full // _BLOCK, _BLOCK))] if full else []
    if full < n:
        parts.append(reduce(x[:, full:].unsqueeze(1)))  # [R, 1]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _block_columns(x: torch.Tensor, block: torch.Tensor, fill: float):
    """The values [R, B] of block [R, 1] of x [R, n] (fill past column n) and their columns [R, B]."""
    columns = block * _BLOCK + torch.arange(_BLOCK, device=x.device)  # [R, B]
    values = x.gather(1, columns.clamp(max=x.shape[-1] - 1))  # [R, B]
    return values.masked_fill(columns >= x.shape[-1], fill), columns


def _below(value: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """min(value, the largest float below bound): a target the cumulative mass is sure to pass."""
    return torch.minimum(value, torch.nextafter(bound, torch.zeros_like(bound)))
