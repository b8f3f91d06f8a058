"""Benchmark: what structured outputs cost an engine in process (issue 30's numbers).

`tandem bench structured --batch 32`: the same `--batch` prompts decode unconstrained and then with every row
under a JSON schema (drawn round-robin from SCHEMAS), rounds alternating `--rounds` times on one engine; the
median whole-step time of the steps that decode all `--batch` rows and nothing else, over the first such steps
of each round (as many as every round has, so both sides see the same context lengths), side by side, and their
ratio (issue 30: <= 1.15 on CPU at batch 32); the mask's own cost (the fill on the host, its application to the
logits). Then the time to first token of a request whose schema is new (compiled on the way) against the same
request again (its grammar cached), median of `--ttft-repeats` pairs (issue 30: new <= 2x cached). Ratios from
one run on one machine; a GPU's absolute times only with the device.
"""
from __future__ import annotations

import argparse
import statistics
import time

SCHEMAS = [
    {"type": "object", "properties": {
        "people": {"type": "array", "minItems": 6, "maxItems": 10, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False}}},
     "required": ["people"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "steps": {"type": "array", "minItems": 5, "maxItems": 8, "items": {"type": "string", "maxLength": 30}},
        "difficulty": {"enum": ["easy", "medium", "hard"]}},
     "required": ["title", "steps", "difficulty"], "additionalProperties": False},
    {"type": "array", "minItems": 8, "maxItems": 12, "items": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "temp": {"type": "number"}, "sunny": {"type": "boolean"}},
        "required": ["city", "temp", "sunny"], "additionalProperties": False}},
]
PROMPT = "Write a detailed JSON answer about item {i}:"


class _TimedFiller:
    """The engine's TokenMaskFiller, timing each fill of a whole batch."""

    def __init__(self, inner, batch: int) -> None:
        self.inner, self.batch, self.seconds, self.words = inner, batch, [], inner.words

    def fill_into(self, grammars, out) -> None:
        started = time.perf_counter()
        self.inner.fill_into(grammars, out)
        if len(grammars) == self.batch:
            self.seconds.append(time.perf_counter() - started)
            self.last = out.copy()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    parser.add_argument("--batch", type=int, default=32, help="rows decoding together")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per request and round")
    parser.add_argument("--rounds", type=int, default=3, help="unconstrained / constrained rounds each")
    parser.add_argument("--ttft-repeats", type=int, default=5, help="new-schema / cached-schema pairs")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def _round(llm, batch: int, max_tokens: int, constrained: bool, seed: int) -> list[float]:
    """Whole-step seconds of this round's steps that decoded all `batch` rows and nothing else."""
    from engine import SamplingParams, StructuredOutputsParams

    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed + i, ignore_eos=not constrained,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)])
                             if constrained else None) for i in range(batch)]
    log = llm.engine.step_log
    before = len(log.records())
    llm.generate([PROMPT.format(i=i) for i in range(batch)], params, use_tqdm=False)
    records = log.records()[before:]
    return [r.step_s for r in records if r.decode_tokens == batch and r.prompt_tokens == 0]


def _ttft(llm, schema: dict, tag: int) -> float:
    from engine import SamplingParams, StructuredOutputsParams

    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0, structured_outputs=StructuredOutputsParams(json=schema))
    started = time.perf_counter()
    engine.add_request(f"ttft-{tag}", engine.tokenizer.encode(PROMPT.format(i=tag)), params)
    while not any(d.new_token_ids for d in engine.step()):
        pass
    return time.perf_counter() - started


def _apply_seconds(llm, batch: int, bitmask) -> float:
    """Median seconds of applying a batch's bitmask to [batch, vocab] logits on the engine's device."""
    import torch

    from engine.sampling.token_mask import apply_token_masks

    class Fixed:
        words = bitmask.shape[1]

        def fill_into(self, grammars, out) -> None:
            out[:] = bitmask

    logits = torch.randn(batch, llm.engine.model_config.vocab_size, device=llm.engine.device)
    times = []
    for _ in range(21):
        started = time.perf_counter()
        apply_token_masks(logits, [object()] * batch, Fixed()).sum().item()  # .item(): the work is done
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    import torch

    from engine import LLM

    if args.batch < 1 or args.rounds < 1 or args.max_tokens < 2 or args.ttft_repeats < 1:
        raise ValueError("--batch, --rounds and --ttft-repeats must be positive, --max-tokens at least 2")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_num_seqs=max(args.batch, 8), enable_prefix_caching=False)
    _round(llm, args.batch, 4, True, 0)  # warm: the tokenizer's llguidance form, every schema compiled
    sampler = llm.engine.runner.sampler
    sampler.mask_filler = timed = _TimedFiller(sampler.mask_filler, args.batch)
    rounds = [(_round(llm, args.batch, args.max_tokens, False, 100 * index),
               _round(llm, args.batch, args.max_tokens, True, 100 * index)) for index in range(args.rounds)]
    steps = min(len(steps) for round_ in rounds for steps in round_)  # the same step numbers: the same contexts
    if steps == 0:
        raise RuntimeError("no step decoded the whole batch alone: raise --max-tokens")
    plain = [t for p, _ in rounds for t in p[:steps]]
    constrained = [t for _, c in rounds for t in c[:steps]]
    base, masked = statistics.median(plain), statistics.median(constrained)
    new, cached = [], []
    for index in range(args.ttft_repeats):
        schema = {**SCHEMAS[0], "properties": {**SCHEMAS[0]["properties"], f"field_{index}_{time.time_ns()}":
                                               {"type": "string"}}}
        new.append(_ttft(llm, schema, 2 * index))
        cached.append(_ttft(llm, schema, 2 * index + 1))
    print(f"structured outputs on {llm.engine.device}, torch threads {torch.get_num_threads()}, batch {args.batch}")
    print(f"decode step, median of {len(plain)} / {len(constrained)} steps: unconstrained {base * 1e3:.1f} ms, "
          f"all rows constrained {masked * 1e3:.1f} ms, ratio {masked / base:.3f}")
    fill, apply = statistics.median(timed.seconds), _apply_seconds(llm, args.batch, timed.last)
    print(f"mask fill of {args.batch} rows (host, llguidance), median of {len(timed.seconds)}: {fill * 1e3:.2f} ms; "
          f"applying it to the logits {apply * 1e3:.2f} ms; together {(fill + apply) / base:.1%} of an "
          f"unconstrained step")
    first, again = statistics.median(new), statistics.median(cached)
    print(f"TTFT of a new schema {first * 1e3:.1f} ms vs cached {again * 1e3:.1f} ms, ratio {first / again:.2f} "
          f"(median of {args.ttft_repeats})")
    llm.close()
    return 0
