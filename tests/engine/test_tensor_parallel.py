"""Tensor parallelism in the engine, over real gloo groups of spawned rank processes: TP greedy output equals
transformers (and the TP=1 engine), bad input is a ValueError at start with no process left, close() stops
every follower and no KV block leaks."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.tp_engine import check_tp_start
from engine.model.default_model import default_model_config
from engine.parallel.group_files import group_files_of, process_alive
from engine.model.tp_layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from tests.support.child_processes import FORKED_RANKS
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.gguf_files import write_gguf

PROMPT_LENGTHS = [1, 7, 17, 40, 150]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# Every TP engine here forks its followers from the fork server (FORKED_RANKS: ~0.1 s a start, against ~3 s of
# imports spawned); the spawned start, the default, is covered by test_followers_exit_when_rank_0_is_killed and
# tests/engine/test_group_files.py.


def _tokens(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def _assert_followers_stopped(processes: list) -> None:
    assert processes and all(not p.is_alive() for p in processes)
    _assert_nothing_left()


def _assert_nothing_left() -> None:
    """No follower process, no shared memory file or store directory of a group this process led."""
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("tandem-tp-rank")]
    assert not group_files_of(os.getpid())


# llama: 4 query / 2 KV heads; qwen2: qkv bias, tied embeddings; qwen3: q/k norms and 1 KV head (fewer than the
# ranks: replicated); TP=4 over llama's 2 KV heads: each held by two ranks; all-reduces through gloo alone too.
@pytest.mark.parametrize("arch,size,reduce", [("llama", 2, "shared_memory"), ("qwen2", 2, "shared_memory"),
                                              ("qwen3", 2, "shared_memory"), ("llama3", 4, "shared_memory"),
                                              ("llama", 2, "gloo")])
def test_tp_greedy_matches_transformers(arch, size, reduce, tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint(arch)
    with LLM(str(path), dtype="float32", device="cpu", tensor_parallel_size=size, tp_cpu_all_reduce=reduce,
             **FORKED_RANKS) as llm:
        layouts = [llm.engine.tp_leader.shard.layout]
        assert llm.engine.kv_cache.head_range == layouts[0].kv_heads
        assert llm.engine.kv_cache.spec.num_kv_heads == max(1, llm.engine.model_config.num_kv_heads // size)
        prompts = random_prompts(PROMPT_LENGTHS, llm.get_tokenizer().vocab_size, seed=1)
        assert _tokens(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)
        assert_all_blocks_free(llm)
        processes = list(llm.engine.tp_leader.processes)
        assert len(processes) == size - 1 and all(p.is_alive() for p in processes)
    _assert_followers_stopped(processes)
    assert all(p.exitcode == 0 for p in processes)  # ended by rank 0's STOP, not killed


def test_tp_with_forks_prefix_cache_preemption_and_logprobs_matches_tp1():
    """The embedded model (vocab 259: the last rank's vocabulary shard is padded) under what moves KV between
    blocks or skips work: n > 1 forks (block copies replayed on the followers), prefix-cache hits, preemption
    by recompute (a 40-block pool), chunked prefill, prompt logprobs (logits gathered in slices)."""
    options = dict(device="cpu", num_kv_blocks=40, max_num_batched_tokens=64, block_size=8, **FORKED_RANKS)
    prompts = random_prompts([30, 30, 90, 5, 120], 256, seed=4)
    prompts[1][:24] = prompts[0][:24]  # a shared prefix of three full blocks
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2 if i == 0 else 1,
                             prompt_logprobs=2 if i == 2 else None, logprobs=1) for i in range(len(prompts))]

    def run(llm: LLM):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert_all_blocks_free(llm)
        return ([[c.token_ids for c in o.outputs] for o in outs],
                [e[t].logprob for o in outs for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                [e[t].logprob for e, t in zip(outs[2].prompt_logprobs[1:], prompts[2][1:])])

    with LLM("tiny", **options) as single:
        expected = run(single)
    with LLM("tiny", tensor_parallel_size=2, **options) as tp:
        got = run(tp)
        assert tp.engine.scheduler.num_preemptions > 0
        processes = list(tp.engine.tp_leader.processes)
    assert got[0] == expected[0]  # every sample's tokens
    assert got[1] == pytest.approx(expected[1], abs=1e-4) and got[2] == pytest.approx(expected[2], abs=1e-4)
    _assert_followers_stopped(processes)


@pytest.mark.parametrize("arch,overrides,size,words", [
    ("llama", {}, 3, "does not divide the model's 4 attention heads"),
    ("qwen3", {"num_attention_heads": 6, "head_dim": 16}, 4, "does not divide the model's 6 attention heads"),
    ("llama", {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8, "intermediate_size": 100}, 8,
     "does not divide the model's intermediate_size 100"),
    ("llama", {"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 8}, 6,
     "is not a multiple of the model's 4 KV heads"),
])
def test_shapes_that_do_not_split_fail_before_any_process_starts(arch, overrides, size, words, tiny_checkpoint):
    path = tiny_checkpoint(arch, **overrides)
    with pytest.raises(ValueError, match=words):
        LLM(str(path), device="cpu", tensor_parallel_size=size, **FORKED_RANKS)
    _assert_nothing_left()


@pytest.mark.parametrize("options,words", [
    ({"kv_cache_memory": 1000}, "holds no block"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64}, "max_num_batched_tokens"),
])
def test_a_failure_after_the_followers_started_kills_them(options, words, tiny_checkpoint):
    with pytest.raises(ValueError, match=words):
        LLM(str(tiny_checkpoint("llama")), device="cpu", tensor_parallel_size=2, **options, **FORKED_RANKS)
    _assert_nothing_left()


def test_bad_tensor_parallel_size_values():
    for size in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
            LLM("tiny", device="cpu", tensor_parallel_size=size)
    assert not multiprocessing.active_children()


def test_a_start_method_other_than_spawn_or_forkserver_is_a_value_error():
    with pytest.raises(ValueError, match="tp_start_method must be 'spawn' or 'forkserver', got 'fork'"):
        EngineConfig(tensor_parallel_size=2, tp_start_method="fork")


def test_tp_from_a_gguf_file_matches_transformers(tiny_checkpoint, hf_greedy, tmp_path):
    """A GGUF file's tensors are read whole, dequantized, then cut per rank."""
    pytest.importorskip("gguf")  # the test writes its file with the gguf package (the engine reads it without)
    path = tiny_checkpoint("llama")
    gguf = write_gguf(path, tmp_path / "llama.gguf", "F32")
    with LLM(str(gguf), dtype="float32", device="cpu", tensor_parallel_size=2, **FORKED_RANKS) as llm:
        prompts = random_prompts([3, 33], 300, seed=2)
        assert _tokens(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)


def test_tp1_builds_the_single_device_model():
    """tensor_parallel_size=1: no parallel layer, no group, no follower; nothing is added to a step."""
    with LLM("tiny", device="cpu") as llm:
        model = llm.engine.runner.model
        assert model.shard is None and llm.engine.tp_leader is None and llm.engine.runner.step_sender is None
        parallel = (ParallelLMHead, RowParallelLinear, VocabParallelEmbedding)
        assert not [m for m in model.modules() if isinstance(m, parallel)]
        assert llm.engine.kv_cache.head_range == (0, 4)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_followers_exit_when_rank_0_is_killed(start_method):
    """Spawned, a follower watches its parent; forked from the fork server, rank 0's pid (its parent is the server)."""
    script = Path(__file__).resolve().parents[1] / "support" / "tp_rank0_process.py"
    repo = Path(__file__).resolve().parents[2]
    rank0 = subprocess.Popen([sys.executable, str(script), start_method], stdout=subprocess.PIPE, text=True, cwd=repo,
                             env={**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    try:
        followers = json.loads(rank0.stdout.readline())
        assert followers and all(process_alive(pid) for pid in followers) and group_files_of(rank0.pid)
    finally:
        rank0.send_signal(signal.SIGKILL)
        rank0.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(process_alive(pid) for pid in followers):
        time.sleep(0.1)
    assert not [pid for pid in followers if process_alive(pid)]
    assert not group_files_of(rank0.pid)  # the followers removed what the killed rank 0 could not


def test_more_ranks_than_gpus_is_a_value_error(monkeypatch):
    """Checked before anything starts (the GPU count is faked: this suite's machines have at most one)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    model_config, config = default_model_config(), EngineConfig(tensor_parallel_size=2)
    check_tp_start(model_config, config, torch.device("cuda", 0))  # ranks on GPUs 0 and 1
    with pytest.raises(ValueError, match=r"needs GPUs 1\.\.2 .* has 2"):
        check_tp_start(model_config, config, torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"needs GPUs 0\.\.1 .* has 1"):
        check_tp_start(model_config, config, torch.device("cuda"))


@pytest.mark.parametrize("reduce", ["shared_memory", "gloo"])
def test_a_dead_follower_fails_the_step_instead_of_hanging(reduce):
    with LLM("tiny", device="cpu", tensor_parallel_size=2, tp_cpu_all_reduce=reduce, **FORKED_RANKS) as llm:
        follower = llm.engine.tp_leader.processes[0]
        follower.kill()
        follower.join()
        started = time.monotonic()
        with pytest.raises(RuntimeError):
            llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)
        assert time.monotonic() - started < 30
    _assert_nothing_left()
