"""`tandem bench memory`: many decodes with a long prompt arriving, on a random model of a real shape.

The engine is built straight from a ModelConfig with seeded random weights (no checkpoint on disk: an 8B
shape would take minutes to save), sized by its own memory plan. `--decodes` requests with short prompts are
admitted and run until every one of them is decoding; then one `--long-prompt`-token prompt arrives and the
engine steps until it has produced its first token and every request has finished. Reported: the memory plan,
the peak allocated memory against the device (CUDA), the median decode step before the long prompt and the
slowest step while it is prefilled (chunked), the long prompt's time to first token, preemptions, and
whether anything ran out of memory (a failure, reported with the numbers, not a crash). The issue's GPU
target: a Llama-3-8B shape in bf16 serves 256 decodes with a 16k prompt arriving without running out of
memory. On CPU the default is the "tiny" shape, to check the command itself.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.core.llm_engine import LLMEngine
from engine.model.causal_lm import CausalLM
from engine.sampling_params import SamplingParams
from engine.text.tokenizer import ByteTokenizer

SHAPES = {
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                         num_kv_heads=2, head_dim=64, max_position_embeddings=32768, rope_theta=1000000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, max_position_embeddings=4096),
}


@dataclass(frozen=True)
class StressResult:
    shape: str
    device: str
    dtype: str
    decodes: int
    long_prompt: int
    memory_plan: str
    kv_blocks: int
    peak_allocated_gib: float | None   # CUDA only
    device_total_gib: float | None
    decode_step_ms_before: float       # median step with only the decodes running
    slowest_step_ms_during: float      # slowest step while the long prompt was prefilled
    long_prompt_ttft_s: float
    preemptions: int
    finished: int
    out_of_memory: str | None = None


def model_config(shape: str) -> ModelConfig:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    return ModelConfig(architecture="LlamaForCausalLM", eos_token_ids=(), **SHAPES[shape])


def build_random_engine(cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                        seed: int = 0) -> LLMEngine:
    """An LLMEngine over a CausalLM of shape cfg with seeded random weights drawn on the device."""
    max_positions = min(cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings)
    model = CausalLM(cfg, dtype, max_positions).materialize(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.prepare_kernels()
    return LLMEngine(model.eval(), ByteTokenizer(), cfg, config, dtype, device)


def run_stress(engine: LLMEngine, decodes: int, prompt_len: int, long_prompt: int, max_tokens: int) -> dict:
    """Drives the workload of the module docstring; returns the measured numbers (not the memory ones)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(1)
    for i in range(decodes):
        engine.add_request(f"decode-{i}", torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params)
    before, decoding, finished = [], set(), set()

    def step() -> tuple[list, float]:
        deltas, ms = _timed_step(engine)
        finished.update(d.request_id for d in deltas if d.finish_reason is not None)
        return deltas, ms

    while len(decoding) < decodes and engine.has_unfinished_requests():
        decoding |= {d.request_id for d in step()[0]}
    for _ in range(8):  # steady decode steps, nothing else scheduled
        before.append(step()[1])
    long_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("long", torch.randint(0, vocab, (long_prompt,), generator=gen).tolist(), long_params)
    start, first_token_s, during = time.perf_counter(), None, []
    while engine.has_unfinished_requests():
        deltas, ms = step()
        if first_token_s is None:
            during.append(ms)
            if any(d.request_id == "long" for d in deltas):
                first_token_s = time.perf_counter() - start
    return dict(decode_step_ms_before=statistics.median(before) if before else 0.0,
                slowest_step_ms_during=max(during, default=0.0), long_prompt_ttft_s=first_token_s or 0.0,
                preemptions=engine.scheduler.num_preemptions, finished=len(finished))


def _timed_step(engine: LLMEngine):
    _sync(engine.device)
    start = time.perf_counter()
    deltas = engine.step()
    _sync(engine.device)
    return deltas, (time.perf_counter() - start) * 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default=None, choices=list(SHAPES),
                        help="model shape (default: llama-3-8b on CUDA, tiny on CPU)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--decodes", type=int, default=None, help="concurrent decodes (default: 256 CUDA, 16 CPU)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each decode")
    parser.add_argument("--long-prompt", type=int, default=None, help="tokens (default: 16384 CUDA, 1024 CPU)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each decode generates")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-mib", type=int, default=None,
                        help="fixed KV pool (default: the memory plan on CUDA, 256 MiB on CPU)")
    parser.add_argument("--json", default=None, help="write the result as JSON to this file")


def run(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    cuda = device.type == "cuda"
    shape = args.shape or ("llama-3-8b" if cuda else "tiny")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    decodes, long_prompt = args.decodes or (256 if cuda else 16), args.long_prompt or (16384 if cuda else 1024)
    if min(decodes, long_prompt, args.prompt_len, args.max_tokens) < 1:
        raise ValueError("--decodes, --long-prompt, --prompt-len and --max-tokens must be >= 1")
    cfg = model_config(shape)
    pool = (args.kv_cache_mib << 20) if args.kv_cache_mib else (None if cuda else 256 << 20)
    config = EngineConfig(max_num_seqs=decodes + 1, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=long_prompt + 64, gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory=pool)
    result = _measure(shape, cfg, config, dtype, device, decodes, args, long_prompt)
    _print(result)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(asdict(result), out, indent=2)
    return 0 if result.out_of_memory is None and result.finished == decodes + 1 else 1


def _measure(shape, cfg, config, dtype, device, decodes, args, long_prompt) -> StressResult:
    cuda = device.type == "cuda"
    common = dict(shape=shape, device=str(device), dtype=str(dtype).removeprefix("torch."), decodes=decodes,
                  long_prompt=long_prompt)
    try:
        engine = build_random_engine(cfg, config, dtype, device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        numbers = run_stress(engine, decodes, args.prompt_len, long_prompt, args.max_tokens)
        oom = None
    except torch.cuda.OutOfMemoryError as error:
        return StressResult(**common, memory_plan="-", kv_blocks=0, peak_allocated_gib=None, device_total_gib=None,
                            decode_step_ms_before=0.0, slowest_step_ms_during=0.0, long_prompt_ttft_s=0.0,
                            preemptions=0, finished=0, out_of_memory=str(error).splitlines()[0])
    peak = torch.cuda.max_memory_allocated(device) / (1 << 30) if cuda else None
    total = torch.cuda.get_device_properties(device).total_memory / (1 << 30) if cuda else None
    return StressResult(**common, memory_plan=engine.memory_plan.describe(), kv_blocks=engine.num_total_blocks,
                        peak_allocated_gib=peak, device_total_gib=total, out_of_memory=oom, **numbers)


def _print(result: StressResult) -> None:
    print(f"bench memory: {result.shape} {result.dtype} on {result.device}: {result.decodes} decodes, then a "
          f"{result.long_prompt}-token prompt")
    for key, value in asdict(result).items():
        if key not in ("shape", "dtype", "device", "decodes", "long_prompt"):
            print(f"  {key:24s} {value if not isinstance(value, float) else round(value, 2)}")
