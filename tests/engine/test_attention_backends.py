"""The attention backends: the numba decode kernel against a reference, each backend in the engine against
transformers, and the choice of backend (auto, and clear errors for one that cannot run)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams
from engine.attention import paged_decode_cpu, select_backend
from engine.attention.backends import triton_available
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import TEST_DEVICE, make_llm

needs_numba = pytest.mark.skipif(not paged_decode_cpu.AVAILABLE, reason="numba is not installed")
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def reference_decode(q, k_pool, v_pool, tables, lens, block_size):
    outs = []
    for b, length in enumerate(lens.tolist()):
        pos = torch.arange(length)
        slots = tables[b, pos // block_size] * block_size + pos % block_size
        k, v = k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1)  # [H_kv, L, D]
        outs.append(F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, enable_gqa=True).squeeze(1))
    return torch.stack(outs)


@needs_numba
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 64), (4, 4, 16), (6, 1, 24)])
def test_kernel_matches_reference(heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(0)
    block_size, num_blocks, batch = 4, 64, 5
    k_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
    v_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
    lens = torch.tensor([1, 4, 5, 17, 33], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:9] for _ in range(batch)]).int()
    q = torch.randn(batch, heads, head_dim, generator=generator)
    expected = reference_decode(q, k_pool, v_pool, tables, lens, block_size)
    for head_splits in (None, *range(1, kv_heads + 1)):  # each sequence whole, or its KV heads shared out
        got = paged_decode_cpu.paged_decode_attention(q, k_pool, v_pool, tables, lens, block_size, head_splits)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    rows = torch.full((batch + 2, heads, head_dim), float("nan"))  # a layer's output rows: the decodes' come first
    written = paged_decode_cpu.paged_decode_attention(q, k_pool, v_pool, tables, lens, block_size, out=rows[:batch])
    assert written.data_ptr() == rows.data_ptr()
    torch.testing.assert_close(rows[:batch], expected, rtol=1e-5, atol=1e-5)
    assert rows[batch:].isnan().all()  # nothing written past the rows given


BACKENDS = ["torch", pytest.param("cpu_kernel", marks=needs_numba), pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_matches_transformers_greedy(backend, tiny_checkpoint, hf_greedy):
    """Short and long prompts, a prompt chunked over several steps (its later chunks attend to the cached
    earlier ones), a repeated prompt that hits the prefix cache, and decode steps mixed with prefills."""
    device = TEST_DEVICE.type if backend == "triton" else "cpu"  # triton: the GPU, or the interpreter on CPU
    path = tiny_checkpoint("llama3")  # two layers: each reads and writes its own part of the pool
    llm = make_llm(str(path), dtype="float32", device=device, attention_backend=backend,
                   max_num_batched_tokens=16, block_size=8, max_model_len=64)  # small: Triton's interpreter
    assert llm.engine.runner.attention.name == backend
    prompts = random_prompts([1, 9, 20, 40], llm.get_tokenizer().vocab_size, seed=9)  # 40: three chunks
    prompts.append(prompts[3][:36] + prompts[1])  # shares 32 tokens (4 blocks) with prompt 3
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == hf_greedy(path, prompts, 6)
    again = llm.generate(prompt_token_ids=prompts[3:], sampling_params=params)  # now from the prefix cache
    assert [o.outputs[0].token_ids for o in again] == got[3:]
    assert_all_blocks_free(llm)


def test_auto_picks_by_device_and_dtype():
    cpu = torch.device("cpu")
    expected = "cpu_kernel" if paged_decode_cpu.AVAILABLE else "torch"
    assert select_backend("auto", cpu, torch.float32).name == expected
    assert select_backend("auto", cpu, torch.bfloat16).name == "torch"


def test_backends_that_cannot_run_say_why(monkeypatch):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="cpu_kernel.*float32"):
        select_backend("cpu_kernel", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown attention_backend"):
        make_llm("tiny", attention_backend="flash")
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        make_llm("tiny", enforce_eager="yes")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("triton", cpu, torch.float32)


@needs_numba
def test_a_cpu_engine_keeps_the_thread_count_it_was_started_with():
    """A process caps torch at its share of the cores before its engine starts (without OMP_NUM_THREADS); the
    numba kernel's first parallel launch (at engine start, in a fresh process) must not raise it to every core."""
    import os
    import subprocess
    import sys
    code = ("import torch; torch.set_num_threads(1)\n"
            "from engine.builder import build_engine\nfrom engine.config import EngineConfig\n"
            "engine = build_engine('tiny', EngineConfig(kv_cache_memory=1 << 22), device='cpu')\n"
            "assert engine.runner.attention.name == 'cpu_kernel', engine.runner.attention.name\n"
            "print(torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "1"
