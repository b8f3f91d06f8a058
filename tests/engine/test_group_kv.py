"""KV blocks between a tensor-parallel group's ranks and one full-head tensor on rank 0
(engine/runner/group_kv.py), over real gloo groups of spawned ranks: a gather equals the single-rank engine's KV of
the same prompt, a scatter writes each rank exactly its heads (replicated heads on every rank that holds them)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.support.engine_checks import assert_all_blocks_free, random_prompts

PREFILL = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)  # 1: the first token ends it, no KV kept


def _prefilled_kv(engine, prompt: list[int], gather) -> torch.Tensor:
    """Prefill `prompt` as a prefill-only request; the KV of its blocks by `gather`, then the blocks freed."""
    engine.add_request("r", prompt, PREFILL, prefill_only=True)
    while not any(delta.kv_block_ids is not None for delta in engine.step()):
        pass
    blocks = engine.take_prefilled_blocks("r")
    try:
        return gather(blocks).clone()
    finally:
        engine.free_blocks(blocks)


# llama: 2 KV heads over 2 ranks (one each); qwen3: 1 KV head, replicated on both ranks
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gathered_heads_equal_the_single_rank_engines_kv(arch, tiny_checkpoint):
    path = str(tiny_checkpoint(arch))
    prompt = random_prompts([37], 200, seed=3)[0]
    with LLM(path, dtype="float32", device="cpu") as single:
        engine = single.engine
        expected = _prefilled_kv(engine, prompt, lambda ids: engine.kv_cache.kv[:, :, ids])
    with LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2) as group:
        engine = group.engine
        got = _prefilled_kv(engine, prompt, engine.tp_leader.gather_kv_heads)
        assert got.shape == expected.shape  # [L, 2, n, bs, num_kv_heads, D]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        assert_all_blocks_free(group)


@pytest.mark.parametrize("arch,size", [("llama", 2), ("qwen3", 2), ("llama3", 4)])
def test_a_scatter_writes_each_rank_its_heads_and_a_gather_reads_them_back(arch, size, tiny_checkpoint):
    with LLM(str(tiny_checkpoint(arch)), dtype="float32", device="cpu", tensor_parallel_size=size) as group:
        engine, leader = group.engine, group.engine.tp_leader
        blocks = engine.reserve_blocks(3)
        kv = engine.kv_cache.kv
        full = torch.randn(kv.shape[0], 2, 3, kv.shape[3], engine.model_config.num_kv_heads, kv.shape[5])
        leader.scatter_kv_heads(blocks, full)
        lo, hi = engine.kv_cache.head_range
        assert torch.equal(kv[:, :, blocks], full[..., lo:hi, :])  # rank 0's own heads
        assert torch.equal(leader.gather_kv_heads(blocks), full)   # every rank's, back on rank 0
        engine.free_blocks(blocks)
        prompts = random_prompts([5, 20], engine.model_config.vocab_size, seed=2)
        assert [len(o.outputs[0].token_ids) for o in group.generate(prompt_token_ids=prompts,
                sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))] == [4, 4]  # the group still steps
        assert_all_blocks_free(group)
