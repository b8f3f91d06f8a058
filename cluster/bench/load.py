"""Benchmark: a model's load time to its first token, in fresh processes, stage by stage.

`tandem bench load --model default --runs 5` starts `--runs` Python processes one after another; each imports
torch, imports the engine, builds `LLM(model)` and asks one chat question for a single greedy token, then closes
the engine and reports when each stage ended. The table gives each stage's median, min and max, and the two
totals that matter: from the `LLM(...)` call to the first token (what a user of the library waits for) and from
the process's start to the first token (the same plus Python's imports: what `tandem serve` waits for). Fresh
processes, because a second engine in one process finds oneDNN's kernels and torch's lazy imports already done.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STAGES = ("python start", "import torch", "import engine", "LLM()", "first token")
TOTALS = {"LLM() to first token": ("LLM()", "first token"),
          "process start to first token": ("python start", "import torch", "import engine", "LLM()", "first token")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="a checkpoint directory, a GGUF file, 'tiny', or 'default' (the trained default model)")
    parser.add_argument("--runs", type=int, default=5, help="fresh processes, one after another")
    parser.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES",
                        help="the KV pool's size (default: the engine's)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", default=None, help="write every run's stage times as JSON to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    runs = [_one_fresh_process(args) for _ in range(args.runs)]
    print(f"model {runs[0]['model']} on {runs[0]['device']}: first token {runs[0]['text']!r}; {args.runs} fresh "
          "processes")
    for line in format_table(runs):
        print(line)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"model": runs[0]["model"], "runs": runs}, out, indent=2)
    return 0


def format_table(runs: list[dict]) -> list[str]:
    """Median, min and max seconds of each stage and of TOTALS over the runs (each a child's report)."""
    rows = [(stage, [r["seconds"][stage] for r in runs]) for stage in STAGES]
    rows += [(name, [sum(r["seconds"][s] for s in parts) for r in runs]) for name, parts in TOTALS.items()]
    lines = [f"{'stage':30s} {'median':>8s} {'min':>8s} {'max':>8s}"]
    for name, values in rows:
        lines.append(f"{name:30s} {statistics.median(values):8.2f} {min(values):8.2f} {max(values):8.2f}")
    return lines


def _one_fresh_process(args: argparse.Namespace) -> dict:
    """One child process's report; its 'python start' is from the spawn here to its first line of code."""
    command = [sys.executable, "-m", "cluster.bench.load", "--child", "--model", args.model, "--device", args.device]
    if args.kv_cache_memory is not None:
        command += ["--kv-cache-memory", str(args.kv_cache_memory)]
    spawned = time.time()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the load process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["seconds"]["python start"] = report.pop("started_at") - spawned
    return report


def _child(args: argparse.Namespace) -> None:
    """Load, answer one token, print a JSON report: each stage's seconds and the wall clock at start."""
    started_at = time.time()
    marks = [time.perf_counter()]
    import torch  # noqa: F401  (timed: the import itself is a stage)
    marks.append(time.perf_counter())
    from engine.builder import resolve_model
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    marks.append(time.perf_counter())
    model = resolve_model(None) if args.model == "default" else args.model
    options = {} if args.kv_cache_memory is None else {"kv_cache_memory": args.kv_cache_memory}
    with LLM(model=model, device=args.device, **options) as llm:
        marks.append(time.perf_counter())
        out = llm.chat(QUESTION, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        marks.append(time.perf_counter())
        device = str(llm.engine.device)
    seconds = {stage: later - earlier for stage, earlier, later in zip(STAGES[1:], marks, marks[1:])}
    print(json.dumps({"model": str(model), "device": device, "text": out[0].outputs[0].text,
                      "started_at": started_at, "seconds": seconds}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tandem bench load")
    add_arguments(parser)
    _child(parser.parse_args())
