"""Sampler: one next token per sampled row, greedy or temperature / min-p / top-k / top-p, seedable per
request, with the row's logprobs when it asks.

In two halves. `plan` runs on the host while the step is prepared, before its forward: it decides what each row
needs and puts every host value the device will read (the constrained rows' grammar bitmask, the processors'
indexes, biases and penalty histories, the rows and per-row parameters of non-greedy rows where they differ, the
uniforms of seeded rows, the rows asking for logprobs) into the step's Uploads (engine/host_lists.py), which cross
in the step's one host-to-device copy (engine/step_io.py). `sample_planned` then runs on the logits' device
(CPU or CUDA), vectorised over rows, reading only those bound uploads: first the token masks of rows under a
grammar (engine/sampling/token_mask.py), then the logits processors (engine/sampling/logits_processors.py:
min_tokens, logit_bias, penalties) on the rows that ask for any, greedy rows included (it changes their argmax).
Greedy rows are then an argmax; the others are scaled by temperature, cut by min-p, then `candidate_probs`
(engine/sampling/sampling_plan.py): no cut is a softmax, nothing sorted; top-k is a `torch.topk` partial sort of
the largest k asked for (each row masks past its own k), top-p then cut within those candidates; top-p without
top-k takes each row's top tokens by a ladder of partial sorts that stops where they hold the nucleus, a full sort
only past the ladder and on a GPU (engine/sampling/nucleus.py). The draw is an inverse CDF, one uniform per row, in
two levels (engine/sampling/draw.py). Rows asking for logprobs get `logprob_tensors` (log_softmax of the processed
logits after temperature, before the cuts) beside the draw. The one device-to-host copy brings the tokens, the
small [L, 2 + 2k] logprob tensor and whatever the caller appends (a step's prompt logprobs) back together.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.host_lists import HostCopy, Uploads
from engine.sampling.draw import argmax
from engine.sampling.logits_processors import History, Processing, apply_min_p, apply_processing, plan_processing
from engine.sampling.logprobs import LogprobPlan, TokenLogprobs, logprob_tensors, plan_logprobs, unpack
from engine.sampling.sampling_plan import Draw, draw_rows, plan_draw
from engine.sampling.token_mask import MaskPlan, TokenMaskFiller, apply_planned_masks, plan_token_masks
from engine.sampling_params import SamplingParams
from engine.step_io import StepIO


@dataclass(frozen=True)
class SamplerOutput:
    """One step's picks: a token per row, and per row its TokenLogprobs (None where not asked)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass(frozen=True)
class StepSampling:
    """A step's sampling planned on the host (Sampler.plan): what runs on the device once `uploads` are bound."""

    params: tuple[SamplingParams, ...]
    uploads: Uploads
    masks: MaskPlan | None
    processing: Processing | None
    draw: Draw | None
    logprobs: LogprobPlan | None


class DevicePicks:
    """One step's picks on the device (Sampler.sample_planned), with their copy to the host under way: the tokens,
    then the packed logprobs of the rows that asked, then the caller's tail."""

    def __init__(self, tokens: torch.Tensor, host: HostCopy, params: tuple[SamplingParams, ...],
                 logprobs: LogprobPlan | None) -> None:
        self.tokens = tokens  # [S] int64, on the logits' device
        self.host, self.params, self.logprobs = host, params, logprobs
        self._values: list | None = None

    def values(self) -> list:
        """Everything the copy brought (waits for it once)."""
        if self._values is None:
            self._values = self.host.wait()
        return self._values

    def result(self) -> SamplerOutput:
        """The picks on the host (waits for the copy)."""
        values, count = self.values(), len(self.params)
        picks = values[:count] if len(values) == count else [int(t) for t in values[:count]]  # floats when packed
        if self.logprobs is None:
            return SamplerOutput(picks, [None] * count)
        end = count + len(self.logprobs.asked) * self.logprobs.width
        return SamplerOutput(picks, unpack(values[count:end], picks, self.params, list(self.logprobs.asked)))

    def tail(self) -> list:
        """The values appended after the picks and their logprobs (Sampler.sample_planned's tail)."""
        width = 0 if self.logprobs is None else len(self.logprobs.asked) * self.logprobs.width
        return self.values()[len(self.params) + width:]


class Sampler:
    """Picks tokens from logits. A seeded row draws its uniform from a generator seeded from (seed, position), so a
    seeded request gets the same tokens whatever shares its batch and whichever engine samples which of its tokens;
    unseeded rows share the sampler's generator for that device (one per device, created on first use, each seeded
    with `seed`). eos_token_ids: what min_tokens masks besides a request's stop_token_ids (unless it ignores EOS).
    mask_filler: what fills the bitmask of rows under a grammar (set by the engine at its first structured request).
    start_copy: how the picks start back to the host (engine/step_io.py StepIO.start_to_host: one counted
    copy); a plain `tolist` at wait() if None."""

    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = (),
                 mask_filler: TokenMaskFiller | None = None,
                 start_copy: Callable[[torch.Tensor], HostCopy] | None = None) -> None:
        self.seed = seed
        self.eos_token_ids = tuple(eos_token_ids)
        self.mask_filler = mask_filler
        self.start_copy = start_copy or (lambda values: HostCopy(values, values.numel(), None))
        self._generators: dict[torch.device, torch.Generator] = {}
        self._io: dict[torch.device, object] = {}  # StepIO per device, for calls made outside a step

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
                         constraints: Sequence[object | None] | None = None) -> DevicePicks:
        """`sample` outside a step, stopping once the picks are on the device and their copy to the host has
        started: planned, its uploads sent in one copy of their own (io_for: none when nothing differs), sampled."""
        plan = self.plan(params, positions, histories, constraints, logits.shape[1], Uploads())
        self.io_for(logits.device).upload_alone(plan.uploads)
        return self.sample_planned(logits, plan)

    def io_for(self, device: torch.device):
        """The StepIO (engine/step_io.py) of calls made outside a step on device; its copies counted."""
        if device not in self._io:
            self._io[device] = StepIO(device)
        return self._io[device]

    def plan(self, params: Sequence[SamplingParams], positions: Sequence[int], histories: Sequence[History] | None,
             constraints: Sequence[object | None] | None, vocab: int, uploads: Uploads) -> StepSampling:
        """The host half (arguments as `sample`'s, vocab: the logits' width): fills the constrained rows' bitmask
        and draws the seeded rows' uniforms; adds every array the device half reads to uploads (bind them before
        sample_planned). Changes nothing else."""
        return StepSampling(tuple(params), uploads, plan_token_masks(constraints, self.mask_filler, uploads),
                            plan_processing(params, histories, self.eos_token_ids, vocab, uploads),
                            plan_draw(params, positions, vocab, uploads), plan_logprobs(params, uploads))

    def sample_planned(self, logits: torch.Tensor, plan: StepSampling, tail: torch.Tensor | None = None) -> DevicePicks:
        """The device half: logits [S, vocab] -> the picks [S] on the device and their one copy to the host started,
        with the logprobs asked and tail (1-D float64 on the device, e.g. prompt logprobs) behind them. Advances the
        shared generator by the unseeded drawn rows."""
        uploads = plan.uploads
        logits = apply_planned_masks(logits, plan.masks, uploads)  # [S, vocab]
        logits = apply_processing(logits, plan.processing, uploads)  # [S, vocab]
        tokens = argmax(logits)  # [S] int64: the greedy pick, and the fallback of every row
        if plan.draw is not None:
            tokens = self._draw(logits, tokens, plan.draw, uploads)  # [S]
        if plan.logprobs is None and tail is None:
            return DevicePicks(tokens, self.start_copy(tokens), plan.params, None)  # the one device-to-host copy
        parts = [tokens.double()]
        if plan.logprobs is not None:
            parts.append(logprob_tensors(logits, tokens, plan.logprobs, uploads).flatten())  # [L * (2 + 2k)]
        if tail is not None:
            parts.append(tail)
        return DevicePicks(tokens, self.start_copy(torch.cat(parts)), plan.params, plan.logprobs)

    def _draw(self, logits: torch.Tensor, tokens: torch.Tensor, plan: Draw, uploads: Uploads) -> torch.Tensor:
        """tokens [S] with the drawn rows' picks in place of their argmax (where a row has mass)."""
        index = None if plan.rows is None else uploads.get(plan.rows)  # [R]
        scaled = (logits if index is None else logits.index_select(0, index)).float()  # [R, vocab]
        if plan.temperature is not None:
            scaled = scaled / uploads.per_row(plan.temperature)  # [R, vocab]
        if plan.min_p is not None:
            scaled = apply_min_p(scaled, uploads.per_row(plan.min_p))  # [R, vocab]
        drawn = draw_rows(scaled, plan.cuts, self._uniforms(plan, uploads, logits.device), uploads)  # [R], -1: no mass
        fallback = tokens if index is None else tokens.index_select(0, index)  # [R]
        drawn = torch.where(drawn >= 0, drawn, fallback)  # [R]
        return drawn if index is None else tokens.index_copy(0, index, drawn)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def _uniforms(self, plan: Draw, uploads: Uploads, device: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per drawn row ([R]): seeded rows' from the uploads, the others from the shared
        generator, in row order."""
        shared = torch.rand(plan.num_unseeded, generator=self._generator(device), device=device) \
            if plan.num_unseeded else None  # [U]
        if plan.seeded is None:
            return shared
        seeded = uploads.get(plan.seeded)  # [R]
        return seeded if shared is None else seeded.index_copy(0, uploads.get(plan.unseeded), shared)


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution the sampler draws from: raw logits [R, vocab] of non-greedy rows -> [R, vocab]
    probabilities (zero outside each row's min-p / top-k / top-p set; no logits processors: `logits`
    are taken as processed). For tests and inspection."""
    from engine.sampling.logits_processors import min_p_floor
    from engine.sampling.sampling_plan import candidate_probs, plan_cut, row_groups

    uploads = Uploads()
    temperature = uploads.shared_or_add([p.temperature for p in params], "float32")
    floor = min_p_floor(params, uploads)
    groups = row_groups(params, logits.shape[-1])
    cuts = [(group, plan_cut([params[i] for i in group], logits.shape[-1], None, uploads)) for group in groups]
    uploads.bind_each(logits.device)
    scaled = logits.float() / uploads.per_row(temperature)  # [R, vocab]
    scaled = scaled if floor is None else apply_min_p(scaled, uploads.per_row(floor))  # [R, vocab]
    out = torch.zeros_like(scaled)  # [R, vocab]
    for group, cut in cuts:
        index = torch.tensor(group, dtype=torch.long, device=logits.device)  # [G]
        probs, ids = candidate_probs(scaled.index_select(0, index), cut, uploads)
        dense = probs if ids is None else torch.zeros_like(out[: len(group)]).scatter_(1, ids, probs)
        out.index_copy_(0, index, dense)
    return out
