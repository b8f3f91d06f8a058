"""The warm-up at engine start (engine/core/warmup.py): it runs a pure prefill, a mixed and decode steps, leaves the
engine as it found it (no request, every block free, nothing cached, no counters), serving afterwards equals
transformers and an engine never warmed up, and no launch while serving needs a kernel variant the warm-up did not
compile (Triton's cache key of every launch, tests/support/triton_specialisations.py). And one Triton cache
directory per worker."""
from __future__ import annotations

import os

import pytest

from engine import SamplingParams
from engine.attention.backends import triton_available
from engine.core.warmup import triton_cache_dir, use_triton_cache_dir, warm_up
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import TEST_DEVICE, make_llm

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
# small enough for Triton's interpreter (its cost grows with every token a kernel sees): two budgets of prompt,
# a mixed step of 16, blocks of 8 (so a 9-token short prompt of the mixed phase ends mid-block)
SMALL = dict(max_num_batched_tokens=16, max_model_len=48, max_num_seqs=8, block_size=8)


def triton_llm(path):
    return make_llm(str(path), dtype="float32", device=TEST_DEVICE.type, attention_backend="triton", **SMALL)


def assert_untouched(llm) -> None:
    engine = llm.engine
    assert_all_blocks_free(llm)
    assert engine.kv_cache.allocator.num_cached_blocks == 0, "the dummy prompts' blocks are still cached"
    assert engine.stats.num_steps == 0 and engine.stats.num_prefill_tokens == 0
    assert engine.step_log.records() == [] and engine.scheduler.num_preemptions == 0


@needs_triton
def test_warm_up_runs_every_step_kind_then_serving_equals_transformers(tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint("qwen2", num_hidden_layers=1)  # the interpreter runs each layer: one is enough here
    llm = triton_llm(path)
    report = warm_up(llm.engine)
    assert report.prefill_steps >= 2 and report.mixed_steps >= 1 and report.decode_steps >= 1, report
    assert report.longest_context == 2 * SMALL["max_num_batched_tokens"] + 2  # two budgets of prompt, two tokens
    assert "warm-up" in report.describe()
    assert_untouched(llm)
    prompts = random_prompts([3, 21, 9], llm.get_tokenizer().vocab_size, seed=7)  # one longer than a step
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=6, temperature=0,
                                                                                    ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, prompts, 6)
    assert_all_blocks_free(llm)
    llm.close()


@needs_triton
def test_nothing_serving_launches_needs_a_compile_the_warm_up_did_not_do(tiny_checkpoint):
    """Serving after warm-up: prompts longer than a step (chunked over a cached prefix), a prefix-cache hit, mixed
    steps, decode batches of 1 to 5 over short and long contexts: every launch's key was one warm-up launched."""
    pytest.importorskip("triton")
    from engine.attention import triton_decode, triton_prefill, triton_store
    from engine.model import fused_triton
    from tests.support.triton_specialisations import SpecialisationRecorder, new_keys

    llm = triton_llm(tiny_checkpoint("llama", num_hidden_layers=1))  # every layer launches the same kernels
    with SpecialisationRecorder(triton_decode, triton_prefill, triton_store, fused_triton) as recorder:
        warm_up(llm.engine)
        warmed = recorder.snapshot()
        prompts = random_prompts([35, 5, 17, 2, 6], llm.get_tokenizer().vocab_size, seed=3)  # 35: three steps
        prompts.append(prompts[2][:10] + [1, 2, 3])  # shares a cached block with the third prompt
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 9, 5, 7, 2, 4)]
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert set(warmed) == set(recorder.keys), "a kernel ran while serving that the warm-up never launched"
    assert new_keys(warmed, recorder.snapshot()) == {}
    assert_all_blocks_free(llm)
    llm.close()


def test_a_warmed_up_engine_serves_as_one_that_never_was(tiny_checkpoint):
    """The same workload (greedy and unseeded sampled rows, prompts that share a prefix) on an engine warmed up and on
    a fresh one: the same tokens and the same steps; so warm-up left no cached prefix, no scheduler state, no draw of
    the shared sampling generator."""
    path = str(tiny_checkpoint("llama"))
    prompts = random_prompts([30, 6, 45, 6], 300, seed=11)
    prompts[3] = prompts[2][:36] + [4, 5]
    params = [SamplingParams(max_tokens=8, temperature=t, ignore_eos=True) for t in (0, 1.0, 0.7, 0)]
    runs = []
    for warm in (True, False):
        llm = make_llm(path, device="cpu", max_num_batched_tokens=48, max_num_seqs=4)
        if warm:
            warm_up(llm.engine)
            assert_untouched(llm)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        steps = [(r.prompt_tokens, r.decode_tokens) for r in llm.engine.step_log.records()]
        runs.append(([o.outputs[0].token_ids for o in outputs], steps, llm.engine.stats.num_prefill_tokens))
        llm.close()
    assert runs[0] == runs[1]


def test_warm_up_refuses_an_engine_already_serving(tiny_checkpoint):
    llm = make_llm(str(tiny_checkpoint("llama")), device="cpu")
    llm.engine.add_request("live", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="no live request"):
        warm_up(llm.engine)
    llm.close()


def test_one_triton_cache_directory_per_worker(tmp_path, monkeypatch):
    prefill, decode = triton_cache_dir("prefill-0", tmp_path), triton_cache_dir("decode 1/gpu:0", tmp_path)
    assert prefill == tmp_path / "prefill-0" and prefill.is_dir()
    assert decode.parent == tmp_path and decode.is_dir() and decode != prefill  # no separator escapes the root
    assert triton_cache_dir("prefill-0", tmp_path) == prefill  # a restarted worker finds its cache again
    monkeypatch.setenv("TANDEM_TRITON_CACHE_ROOT", str(tmp_path / "root"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    path = use_triton_cache_dir("decode-3")
    assert path == tmp_path / "root" / "decode-3" and os.environ["TRITON_CACHE_DIR"] == str(path)
    with pytest.raises(ValueError, match="directory name"):
        triton_cache_dir("../..", tmp_path)
