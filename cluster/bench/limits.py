"""How close the engine runs to the machine's limits.

- prefill: a packed step of PREFILL_PROMPTS x PREFILL_LEN tokens against the bare matmul time of the
  same layers with the same weights (the FLOP-bound floor; attention and norms are what is left);
- decode: the step time at batch 1, 8, 32 (or the batches given; the median forward of the steps that
  decode all of them and nothing else) against the time to read the weights once at the measured memory
  bandwidth (the bandwidth-bound floor of a decode step);
- mixed: a step of MIXED_DECODES decodes and a MIXED_CHUNK-token prompt chunk against a decode step of as many
  rows (measured in the same run) plus the chunk's bare matmuls (issue 27 asks for at most 1.5x that).

A step's time (engine ms) is the longer of its forward on the host's timeline and its span on the device: with
async scheduling a step is issued while the one before it runs, so a step the host takes long to issue shows a
short forward (its issue hid under the step before) but a long span on the device, which waits for its launches
(the H200 run of session 31: a mixed step's forward 2.4 ms, its span 10.9 ms).

`tandem selftest` calls the parts (prefill_row, decode_floor, decode_row, prefill_flops) at its own sizes.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PREFILL_PROMPTS, PREFILL_LEN = 8, 256
DECODE_BATCHES, DECODE_CONTEXT, DECODE_STEPS = (1, 8, 32), 128, 32
MIXED_DECODES, MIXED_CHUNK, MIXED_REPEATS = 32, 512, 3


@dataclass(frozen=True)
class LimitRow:
    phase: str
    batch: str
    engine_ms: float
    floor_ms: float
    floor: str
    host_ms: float | None = None    # decode steps: the host's time to issue one (median)
    device_ms: float | None = None  # ... and the device's time for it (CUDA events; None off CUDA)

    @property
    def ratio(self) -> float:
        return self.engine_ms / self.floor_ms


def measure_limits(llm, decode_batches: tuple[int, ...] = DECODE_BATCHES) -> list[LimitRow]:
    rows = [prefill_row(llm)]
    floor_ms, floor = decode_floor(llm)
    rows += [decode_row(llm, batch, floor_ms, floor) for batch in decode_batches]
    rows.append(mixed_row(llm))
    print(f"\n{'phase':<13} {'batch':<20} {'engine ms':>10} {'host ms':>8} {'device ms':>9} {'floor ms':>9} "
          f"{'ratio':>6}  floor")
    for r in rows:
        print(f"{r.phase:<13} {r.batch:<20} {r.engine_ms:10.2f} {_cell(r.host_ms):>8} {_cell(r.device_ms):>9} "
              f"{r.floor_ms:9.2f} {r.ratio:6.2f}  {r.floor}")
    return rows


def decode_floor(llm) -> tuple[float, str]:
    """(ms to read the weights once at the measured memory bandwidth, how it was computed)."""
    engine = llm.engine
    weight_bytes = _weight_bytes_read_per_step(engine.runner.model)
    bandwidth = memory_bandwidth(engine.device)
    return (weight_bytes / bandwidth * 1e3,
            f"read {weight_bytes / 1e6:.0f} MB of weights at {bandwidth / 1e9:.1f} GB/s")


def decode_row(llm, batch: int, floor_ms: float, floor: str, context: int = DECODE_CONTEXT,
               steps: int = DECODE_STEPS) -> LimitRow:
    engine_ms, host_ms, device_ms = _decode_step_ms(llm, batch, context, steps)
    return LimitRow("decode step", f"{batch} seqs x {context} ctx", engine_ms, floor_ms, floor, host_ms, device_ms)


def mixed_row(llm, decodes: int = MIXED_DECODES, chunk: int = MIXED_CHUNK, repeats: int = MIXED_REPEATS) -> LimitRow:
    """The median forward of the steps that decoded `decodes` sequences and took a prompt chunk at once, against
    the median decode-only step of the same sequences plus the chunk's bare matmuls. A step's prompt bound may
    cut the chunk: the row says how many prompt tokens the steps took."""
    from engine import SamplingParams
    engine, stats, vocab = llm.engine, llm.engine.stats, llm.engine.model_config.vocab_size
    ids = [f"limits-mixed-{i}" for i in range(decodes)]
    long = SamplingParams(max_tokens=8 * (repeats + 2), temperature=0.0, ignore_eos=True)
    for request_id, prompt in zip(ids, fresh_prompts(decodes, DECODE_CONTEXT, vocab, 300)):
        engine.add_request(request_id, prompt, long)
    steps: dict[str, list[float]] = {"decode": [], "mixed": []}
    chunk_tokens, records = [], []
    try:
        for repeat in range(repeats + 1):
            if repeat:  # the first round only brings every sequence to decoding
                prompt = fresh_prompts(1, chunk, vocab, 400 + repeat)[0]
                engine.add_request(f"limits-chunk-{repeat}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            for _ in range(4):
                prefilled, decoded, seconds = stats.num_prefill_tokens, stats.num_decode_tokens, stats.forward_seconds
                engine.step()
                if stats.num_decode_tokens - decoded == decodes:
                    kind = "mixed" if stats.num_prefill_tokens > prefilled else "decode"
                    record = engine.step_log.last()
                    steps[kind].append(_span_s(stats.forward_seconds - seconds, record))
                    if kind == "mixed":
                        chunk_tokens.append(stats.num_prefill_tokens - prefilled)
                        records.append(record)
    finally:
        for request_id in ids + [f"limits-chunk-{r}" for r in range(1, repeats + 1)]:
            engine.abort(request_id)
    if not steps["mixed"] or not steps["decode"]:
        raise RuntimeError(f"no step decoded all {decodes} sequences beside a prompt chunk (max_num_seqs too small?)")
    tokens = statistics.median(chunk_tokens)
    decode_ms = statistics.median(steps["decode"]) * 1e3
    floor_ms = decode_ms + _bare_matmul_ms(engine.runner.model, int(tokens), 1, engine.device)
    return LimitRow("mixed step", f"{decodes} dec + {tokens:.0f} prompt", statistics.median(steps["mixed"]) * 1e3,
                    floor_ms, f"decode step of {decodes} ({decode_ms:.2f} ms) + the chunk's bare matmuls",
                    *_median_host_device_ms(records))


def _span_s(forward_s: float, record) -> float:
    """A step's time: the longer of its forward (host timeline) and its span on the device (None off CUDA)."""
    return max(forward_s, record.device_s or 0.0) if record is not None else forward_s


def _median_host_device_ms(records) -> tuple[float, float | None]:
    """Of these steps' StepRecords (engine/core/step_log.py): the median time the host took to issue one and the
    median device time (None off CUDA), in ms."""
    device = [r.device_s for r in records if r.device_s is not None]
    return statistics.median(r.issue_s for r in records) * 1e3, statistics.median(device) * 1e3 if device else None


def _cell(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.2f}"


def fresh_prompts(count: int, length: int, vocab: int, seed: int | None = None) -> list[list[int]]:
    """count prompts of length random ids in [3, vocab): seeded, or (seed None) different at every call; fresh
    tokens, so the prefix cache never helps."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def _prefill_ms(llm, prompts: list[list[int]]) -> tuple[float, float, float | None]:
    """Generating one token for each prompt: the steps' forward time, the host's time to issue them and the
    device's time for them (engine/core/step_log.py StepRecord; None off CUDA), in ms."""
    from engine import SamplingParams
    stats, log = llm.engine.stats, llm.engine.step_log
    before, started = stats.forward_seconds, time.perf_counter()
    llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                 sampling_params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    records = [r for r in log.records() if r.started_at >= started and r.prompt_tokens]
    device = [r.device_s for r in records if r.device_s is not None]
    return ((stats.forward_seconds - before) * 1e3, sum(r.issue_s for r in records) * 1e3,
            sum(device) * 1e3 if device and len(device) == len(records) else None)


def prefill_row(llm, prompts: int = PREFILL_PROMPTS, length: int = PREFILL_LEN, repeats: int = 3) -> LimitRow:
    vocab = llm.engine.model_config.vocab_size
    runs = [_prefill_ms(llm, fresh_prompts(prompts, length, vocab, seed)) for seed in range(repeats)]
    tokens = prompts * length
    engine_ms = statistics.median(run[0] for run in runs)
    device = [run[2] for run in runs if run[2] is not None]
    bare_ms = _bare_matmul_ms(llm.engine.runner.model, tokens, prompts, llm.engine.device)
    return LimitRow("prefill", f"{prompts} x {length} tokens", engine_ms, bare_ms,
                    f"bare matmuls of the same layers ({tokens / engine_ms * 1e3:.0f} tok/s engine)",
                    statistics.median(run[1] for run in runs), statistics.median(device) if device else None)


def _decode_step_ms(llm, batch: int, context: int, steps: int) -> tuple[float, float, float | None]:
    """Of the steps that decoded all `batch` sequences and nothing else: the median step time (the longer of the
    forward, launch to picks on the host, with async scheduling from the previous step's completion, and the span
    on the device), the host's time to issue one and the device's time for it (engine/core/step_log.py
    StepRecord; None off CUDA)."""
    from engine import SamplingParams
    engine, stats = llm.engine, llm.engine.stats
    params = SamplingParams(max_tokens=1 + steps, temperature=0.0, ignore_eos=True)
    ids = [f"limits-decode-{batch}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, fresh_prompts(batch, context, llm.engine.model_config.vocab_size, 200 + batch)):
        engine.add_request(request_id, prompt, params)
    times, records = [], []
    try:
        while engine.has_unfinished_requests():
            prefilled, decoded, seconds = stats.num_prefill_tokens, stats.num_decode_tokens, stats.forward_seconds
            engine.step()
            if stats.num_prefill_tokens == prefilled and stats.num_decode_tokens - decoded == batch:
                records.append(engine.step_log.last())
                times.append(_span_s(stats.forward_seconds - seconds, records[-1]))
    finally:
        for request_id in ids:
            engine.abort(request_id)
    if not times:
        raise RuntimeError(f"no step decoded all {batch} sequences at once (max_num_seqs too small?)")
    return (statistics.median(times) * 1e3, *_median_host_device_ms(records))


@torch.inference_mode()
def _bare_matmul_ms(model, num_tokens: int, num_sampled: int, device) -> float:
    cfg = model.config
    dtype = model.embed_tokens.weight.dtype
    x = torch.randn(num_tokens, cfg.hidden_size, dtype=dtype, device=device)
    attn = torch.randn(num_tokens, cfg.num_heads * cfg.head_dim, dtype=dtype, device=device)
    act = torch.randn(num_tokens, cfg.intermediate_size, dtype=dtype, device=device)

    def all_layers():
        for layer in model.layers:
            F.linear(x, layer.self_attn.qkv_proj.weight)
            F.linear(attn, layer.self_attn.o_proj.weight)
            F.linear(x, layer.mlp.gate_up_proj.weight)
            F.linear(act, layer.mlp.down_proj.weight)
        model.compute_logits(x[:num_sampled])
    return _median_ms(all_layers, device)


def prefill_flops(model, num_tokens: int, num_sampled: int) -> float:
    """FLOPs of the matmuls `_bare_matmul_ms` times: every layer's projections over num_tokens rows, and
    the LM head over the num_sampled rows (2 flops per multiply-add)."""
    per_token = sum(layer.self_attn.qkv_proj.weight.numel() + layer.self_attn.o_proj.weight.numel()
                    + layer.mlp.gate_up_proj.weight.numel() + layer.mlp.down_proj.weight.numel()
                    for layer in model.layers)
    return 2.0 * (per_token * num_tokens + model.lm_head.weight.numel() * num_sampled)


def _weight_bytes_read_per_step(model) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    if model.lm_head.weight is not embed:  # an untied embedding table is only gathered, not read whole
        total -= embed.numel() * embed.element_size()
    return total


def memory_bandwidth(device) -> float:
    """Bytes/s of a streaming read of a buffer far larger than the caches."""
    data = torch.ones(256 * 1024 * 1024 // 4, dtype=torch.float32, device=device)
    seconds = _median_ms(lambda: data.sum(), device) / 1e3
    return data.numel() * 4 / seconds


def _median_ms(fn, device, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
