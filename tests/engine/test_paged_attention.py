"""The two decode attention paths (numba kernel on CPU float32, torch gather + SDPA) agree."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams, paged_decode_cpu
from tests.support.engine_checks import assert_all_blocks_free, random_prompts

pytestmark = pytest.mark.skipif(not paged_decode_cpu.AVAILABLE, reason="numba is not installed")


def reference_decode(q, k_pool, v_pool, tables, lens, block_size):
    outs = []
    for b, length in enumerate(lens.tolist()):
        pos = torch.arange(length)
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        k, v = k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1)  # [H_kv, L, D]
        outs.append(F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, enable_gqa=True).squeeze(1))
    return torch.stack(outs)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (4, 4, 16), (6, 1, 24)])
def test_kernel_matches_reference(heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(0)
    block_size, num_blocks, batch = 4, 64, 5
    k_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
    v_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
    lens = torch.tensor([1, 4, 5, 17, 33])
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:9] for _ in range(batch)])
    q = torch.randn(batch, heads, head_dim, generator=generator)
    got = paged_decode_cpu.paged_decode_attention(q, k_pool, v_pool, tables, lens, block_size)
    torch.testing.assert_close(got, reference_decode(q, k_pool, v_pool, tables, lens, block_size),
                               rtol=1e-5, atol=1e-5)


def test_engine_output_same_on_both_paths(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    prompts = random_prompts([1, 9, 40, 130], 300, seed=9)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kernel, torch_path = LLM(path), LLM(path)
    torch_path.engine.runner.use_decode_kernel = False
    assert kernel.engine.runner.use_decode_kernel
    got = [o.outputs[0].token_ids for o in kernel.generate(prompt_token_ids=prompts, sampling_params=params)]
    want = [o.outputs[0].token_ids for o in torch_path.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want
    assert_all_blocks_free(kernel)
    assert_all_blocks_free(torch_path)
