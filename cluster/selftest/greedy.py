"""Greedy tokens of engine.LLM against transformers on the tiny checkpoint, in float32 and bfloat16.

The engine generates greedily for prompts of several lengths at once, with a step budget (64 tokens; 32 in the
CPU quick run) below the longest prompt, so decode rows share steps with prefill chunks and later chunks attend
over a cached prefix. transformers then reads each prompt + the engine's tokens in one forward (teacher-forced)
in the same dtype on the same device: a token is equal when it is transformers' argmax there. A random
checkpoint has near-ties (top-2 logits within 1e-3 are common), so a differing token passes only when its logit
is within a dtype's rounding of the max (1e-3 relative in float32, 3e-2 in bfloat16); anything further is a FAIL.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from cluster.selftest.context import quiet_transformers, transformers_missing
from cluster.selftest.kernels import triton_unavailable
from cluster.selftest.results import Outcome, skipped, verdict

RELATIVE_TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}


@dataclass(frozen=True)
class GreedyCase:
    name: str
    dtype: str
    backend: str = "auto"
    eager: bool = False


def cases_for(cuda: bool) -> tuple[GreedyCase, ...]:
    """On CUDA: triton with CUDA graphs in both dtypes, then bf16 without graphs and on the torch path, so a
    failure points at graphs or kernels. On CPU: the numba kernel, the Triton kernels interpreted, bf16."""
    if cuda:
        return (GreedyCase("greedy fp32", "float32"), GreedyCase("greedy bf16", "bfloat16"),
                GreedyCase("greedy bf16 eager", "bfloat16", eager=True),
                GreedyCase("greedy bf16 torch", "bfloat16", backend="torch", eager=True))
    return (GreedyCase("greedy fp32", "float32"), GreedyCase("greedy fp32 triton", "float32", backend="triton"),
            GreedyCase("greedy bf16", "bfloat16"))


def check_greedy(ctx, case: GreedyCase) -> Outcome:
    if reason := transformers_missing():
        return skipped(reason)
    if case.backend == "triton" and (reason := triton_unavailable(ctx)):
        return skipped(reason)
    path = ctx.checkpoint("tiny-llama")
    prompts = random_prompts(ctx.sizes.greedy_prompt_lengths, 512, seed=7)
    generated, engine_note = engine_greedy(ctx, case, str(path), prompts)
    gaps = hf_logit_gaps(ctx, path, case.dtype, prompts, generated)
    total = sum(len(g) for g in gaps)
    equal = sum(1 for g in gaps for gap, _ in g if gap == 0.0)
    worst, prompt_i, pos = max(((gap / scale, i, j) for i, g in enumerate(gaps) for j, (gap, scale) in enumerate(g)),
                               default=(0.0, 0, 0))
    tol = RELATIVE_TOLERANCE[case.dtype]
    lengths_ok = all(len(tokens) == ctx.sizes.greedy_max_tokens for tokens in generated)
    detail = f"greedy {equal}/{total} tokens equal to transformers ({len(prompts)} prompts, {engine_note})"
    if equal < total and worst <= tol:
        detail += f"; the rest at near-ties: max logit gap {worst:.1e} relative (tol {tol:g})"
    elif worst > tol:
        detail += (f"; a token {worst:.1e} (relative) below transformers' max logit, over tol {tol:g}: prompt "
                   f"{prompt_i} ({len(prompts[prompt_i])} tokens), generated token {pos} = {generated[prompt_i][pos]}")
    if not lengths_ok:
        detail += f"; some prompts did not get {ctx.sizes.greedy_max_tokens} tokens"
    return verdict(worst <= tol and lengths_ok and total > 0, detail, tokens=total, equal=equal,
                   max_relative_gap=worst)


def random_prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def engine_greedy(ctx, case: GreedyCase, path: str, prompts: list[list[int]]) -> tuple[list[list[int]], str]:
    """The engine's greedy tokens per prompt, and which attention backend / CUDA graphs produced them."""
    from engine import LLM, SamplingParams

    llm = LLM(path, dtype=case.dtype, device=str(ctx.device), attention_backend=case.backend,
              enforce_eager=case.eager, max_num_batched_tokens=ctx.sizes.greedy_step_tokens, max_num_seqs=8,
              kv_cache_memory=64 << 20)
    try:
        params = SamplingParams(max_tokens=ctx.sizes.greedy_max_tokens, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        runner = llm.engine.runner
        graphs = runner.decode_graphs
        note = runner.attention.name + (f", CUDA graphs {list(graphs.sizes)}" if graphs is not None else "")
        return [list(o.outputs[0].token_ids) for o in outputs], note
    finally:
        del llm


def hf_logit_gaps(ctx, path, dtype: str, prompts, generated) -> list[list[tuple[float, float]]]:
    """Per prompt, per generated token: (transformers' max logit - the token's logit, max(1, |max logit|))."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(path).to(ctx.device, getattr(torch, dtype)).eval()
    gaps = []
    try:
        for prompt, tokens in zip(prompts, generated):
            if not tokens:
                gaps.append([])
                continue
            ids = torch.tensor([prompt + tokens[:-1]], device=ctx.device)
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(prompt) - 1:].float()  # [len(tokens), vocab]
            top = logits.max(dim=-1).values
            chosen = logits[torch.arange(len(tokens), device=ctx.device), torch.tensor(tokens, device=ctx.device)]
            gaps.append(list(zip((top - chosen).tolist(), top.abs().clamp(min=1.0).tolist())))
    finally:
        del model
    return gaps
