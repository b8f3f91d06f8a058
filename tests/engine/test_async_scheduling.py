"""Async scheduling (engine/core/step_pipeline.py) gives exactly what the step-by-step engine gives: the same tokens,
finish reasons and logprobs on a mixed workload with stop tokens, max_tokens, n > 1, seeded samples, penalties,
preemption and aborts, every block back at the end; and it really overlaps: a step's picks feed the next step on
the device and reach the host one step later."""
from __future__ import annotations

from collections import defaultdict

import pytest

from engine import EngineConfig, SamplingParams
from engine.runner.model_runner import ModelRunner
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import make_llm

GREEDY = dict(temperature=0, ignore_eos=True)


def workload(vocab: int, stop_token: int) -> list[tuple[str, list[int], SamplingParams]]:
    prompts = random_prompts([9, 23, 5, 31, 14, 7, 18, 26], vocab, seed=11)
    params = [
        SamplingParams(max_tokens=12, **GREEDY),
        SamplingParams(max_tokens=3, **GREEDY),                                       # ends by length early
        SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_token]),   # a stop token, found late
        SamplingParams(max_tokens=10, temperature=0.9, seed=5, n=2),                 # n > 1, seeded
        SamplingParams(max_tokens=9, temperature=0.8, seed=7, logprobs=2),
        SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, ignore_eos=True),  # reads history
        SamplingParams(max_tokens=14, **GREEDY),                                      # aborted midway
        SamplingParams(max_tokens=1, **GREEDY),
    ]
    return [(f"r{i}", prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))]


def run(path: str, async_on: bool, requests, abort_at: dict[str, int]) -> dict:
    """Every sample's tokens, finish reason and logprobs; a request in abort_at is aborted once it has that many
    tokens. Kept small enough (blocks of 4, 24 of them) that running sequences are preempted."""
    llm = make_llm(path, device="cpu", block_size=4, num_kv_blocks=24, max_num_seqs=8, async_scheduling=async_on)
    engine = llm.engine
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    out = defaultdict(lambda: {"tokens": [], "reason": None, "logprobs": []})
    while engine.has_unfinished_requests():
        for delta in engine.step():
            sample = out[(delta.request_id, delta.index)]
            sample["tokens"] += delta.new_token_ids
            sample["reason"] = delta.finish_reason or sample["reason"]
            sample["logprobs"] += [(lp.logprob, lp.top_ids) for lp in delta.logprobs or ()]
        for request_id, count in abort_at.items():
            if len(out[(request_id, 0)]["tokens"]) >= count and engine.get_sequence(request_id) is not None:
                assert engine.abort(request_id)
    preemptions = engine.scheduler.num_preemptions
    assert_all_blocks_free(llm)
    llm.close()
    return {"samples": dict(out), "preemptions": preemptions}


def test_async_gives_what_sync_gives(tiny_checkpoint, hf_greedy):
    path = str(tiny_checkpoint("llama"))
    vocab = make_llm(path, device="cpu").get_tokenizer().vocab_size
    probe = run(path, False, workload(vocab, stop_token=vocab - 1), {})  # where request 2 would go unstopped
    stop_token = probe["samples"][("r2", 0)]["tokens"][5]  # ... so that it stops at its 6th token or before
    requests = workload(vocab, stop_token)
    sync = run(path, False, requests, {"r6": 4})
    overlapped = run(path, True, requests, {"r6": 4})
    # the same tokens and finish reasons; logprobs to float noise (a step's batch may differ: a sequence whose
    # pending token is its last sits a step out, one that meets a stop token computes one step more)
    assert {k: (v["tokens"], v["reason"]) for k, v in sync["samples"].items()} == \
        {k: (v["tokens"], v["reason"]) for k, v in overlapped["samples"].items()}
    for key, sample in sync["samples"].items():
        got = overlapped["samples"][key]["logprobs"]
        assert [ids for _, ids in sample["logprobs"]] == [ids for _, ids in got]
        assert [lp for lp, _ in sample["logprobs"]] == pytest.approx([lp for lp, _ in got], abs=1e-4)
    assert sync["preemptions"] > 0 and overlapped["preemptions"] > 0
    samples = sync["samples"]
    assert samples[("r2", 0)]["reason"] == "stop" and len(samples[("r2", 0)]["tokens"]) <= 6
    assert len(samples[("r6", 0)]["tokens"]) == 4 and samples[("r6", 0)]["reason"] is None  # aborted
    assert {samples[("r3", 0)]["reason"], samples[("r3", 1)]["reason"]} <= {"length", "stop"}
    greedy = [0, 1, 7]
    expected = hf_greedy(tiny_checkpoint("llama"), [requests[i][1] for i in greedy], 12)
    assert [samples[(f"r{i}", 0)]["tokens"] for i in greedy] == [e[:requests[i][2].max_tokens]
                                                                    for i, e in zip(greedy, expected)]


def test_picks_feed_the_next_step_on_the_device(tiny_checkpoint, hf_greedy, monkeypatch):
    """With async scheduling a greedy request's first token reaches the host from the second step() call, and
    every step after the first takes its rows' ids from the step before it."""
    path = tiny_checkpoint("qwen2")
    llm = make_llm(str(path), device="cpu", async_scheduling=True)
    fed = []
    launch = ModelRunner.launch
    monkeypatch.setattr(ModelRunner, "launch", lambda self, chunks, on_layer=None, fed_by=None:
                        fed.append(fed_by is not None) or launch(self, chunks, on_layer, fed_by))
    prompt = random_prompts([12], llm.get_tokenizer().vocab_size, seed=2)[0]
    llm.engine.add_request("a", prompt, SamplingParams(max_tokens=5, **GREEDY))
    assert llm.engine.step() == []  # the prefill runs; its pick is still on its way
    tokens = [t for _ in range(6) for d in llm.engine.step() for t in d.new_token_ids]
    assert tokens == hf_greedy(path, [prompt], 5)[0]
    assert fed == [False, True, True, True, True]  # 5 steps; the 5th pick ends it: no 6th step is launched
    assert not llm.engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_async_scheduling_refuses_tensor_parallel():
    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size 1"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling must be"):
        EngineConfig(async_scheduling="yes")
    assert EngineConfig().async_scheduling_on("cuda") and not EngineConfig().async_scheduling_on("cpu")
    assert not EngineConfig(tensor_parallel_size=2).async_scheduling_on("cuda")


def test_tandem_serve_takes_the_flag():
    import argparse

    from cluster.serve import add_arguments
    from cluster.serve_flags import engine_config_from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    configs = [engine_config_from_args(parser.parse_args(flags))
               for flags in ([], ["--async-scheduling"], ["--no-async-scheduling"])]
    assert [c.async_scheduling for c in configs] == [None, True, False]
