"""How close the engine runs to the machine's limits.

- prefill: a packed step of PREFILL_PROMPTS x PREFILL_LEN tokens against the bare matmul time of the
  same layers with the same weights (the FLOP-bound floor; attention and norms are what is left);
- decode: the step time at batch 1, 8, 32 against the time to read the weights once at the measured
  memory bandwidth (the bandwidth-bound floor of a decode step).
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


@dataclass(frozen=True)
class LimitRow:
    phase: str
    batch: str
    engine_ms: float
    floor_ms: float
    floor: str

    @property
    def ratio(self) -> float:
        return self.engine_ms / self.floor_ms


def measure_limits(llm) -> list[LimitRow]:
    engine = llm.engine
    rows = [_prefill_row(llm)]
    weight_bytes = _weight_bytes_read_per_step(engine.runner.model)
    bandwidth = memory_bandwidth(engine.device)
    floor_ms = weight_bytes / bandwidth * 1e3
    for batch in DECODE_BATCHES:
        rows.append(LimitRow("decode step", f"{batch} seqs x {DECODE_CONTEXT} ctx",
                             _decode_step_ms(llm, batch), floor_ms,
                             f"read {weight_bytes / 1e6:.0f} MB of weights at {bandwidth / 1e9:.1f} GB/s"))
    print(f"\n{'phase':<13} {'batch':<20} {'engine ms':>10} {'floor ms':>9} {'ratio':>6}  floor")
    for r in rows:
        print(f"{r.phase:<13} {r.batch:<20} {r.engine_ms:10.2f} {r.floor_ms:9.2f} {r.ratio:6.2f}  {r.floor}")
    return rows


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # fresh tokens per call, so the prefix cache never helps
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def _forward_seconds(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from engine import SamplingParams
    stats = llm.engine.stats
    before = stats.forward_seconds
    llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                 sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return stats.forward_seconds - before


def _prefill_row(llm) -> LimitRow:
    vocab = llm.engine.model_config.vocab_size
    times = [_forward_seconds(llm, _prompts(PREFILL_PROMPTS, PREFILL_LEN, vocab, seed), 1)
             for seed in range(3)]
    tokens = PREFILL_PROMPTS * PREFILL_LEN
    engine_ms = statistics.median(times) * 1e3
    bare_ms = _bare_matmul_ms(llm.engine.runner.model, tokens, PREFILL_PROMPTS, llm.engine.device)
    return LimitRow("prefill", f"{PREFILL_PROMPTS} x {PREFILL_LEN} tokens", engine_ms, bare_ms,
                    f"bare matmuls of the same layers ({tokens / engine_ms * 1e3:.0f} tok/s engine)")


def _decode_step_ms(llm, batch: int) -> float:
    vocab = llm.engine.model_config.vocab_size
    prefill_only = _forward_seconds(llm, _prompts(batch, DECODE_CONTEXT, vocab, 100 + batch), 1)
    with_decode = _forward_seconds(llm, _prompts(batch, DECODE_CONTEXT, vocab, 200 + batch),
                                   1 + DECODE_STEPS)
    return (with_decode - prefill_only) / DECODE_STEPS * 1e3


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
