"""What a step may hold while sequences decode (max_prefill_tokens_while_decoding), read back from the engine's
step log; the bound changes how prompts are split into steps, never the output."""
from __future__ import annotations

import pytest

from engine import EngineConfig, SamplingParams
from engine.config import CUDA_PREFILL_BOUND
from engine.core.step_log import StepLog, StepRecord
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import make_llm

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BOUND = 24


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama3"))


def run_with_late_prompts(llm) -> dict[str, list[int]]:
    """Two requests start decoding; then three prompts (40, 30 and 17 tokens) arrive at once. Returns each
    request's output tokens."""
    engine = llm.engine
    early = random_prompts([12, 9], 300, seed=31)
    late = random_prompts([40, 30, 17], 300, seed=32)
    for index, prompt in enumerate(early):
        engine.add_request(f"early{index}", prompt, PARAMS)
    engine.step()  # the early prompts: from here on, sequences decode
    for index, prompt in enumerate(late):
        engine.add_request(f"late{index}", prompt, PARAMS)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return outputs


def prompt_steps(llm) -> list[tuple[int, int]]:
    """(prompt tokens, decode tokens) of each step after the first that took prompt tokens."""
    return [(step.prompt_tokens, step.decode_tokens) for step in llm.engine.step_log.records()[1:]
            if step.prompt_tokens]


@pytest.mark.parametrize("prefill_first", ["off", "on"])
def test_no_step_taken_while_sequences_decode_holds_more_prompt_tokens_than_the_bound(ckpt, prefill_first):
    bounded = make_llm(ckpt, max_num_batched_tokens=512, prefill_first=prefill_first,
                       max_prefill_tokens_while_decoding=BOUND)
    unbounded = make_llm(ckpt, max_num_batched_tokens=512, prefill_first=prefill_first)
    assert run_with_late_prompts(bounded) == run_with_late_prompts(unbounded)
    steps = bounded.engine.step_log.records()
    assert steps[0].prompt_tokens == 21 and steps[0].decode_tokens == 0  # nothing decoded yet: no bound
    assert all(step.prompt_tokens <= BOUND for step in steps[1:])          # every later step: decodes ran
    assert sum(step.prompt_tokens for step in steps) == 12 + 9 + 40 + 30 + 17
    assert max(step.prompt_tokens for step in unbounded.engine.step_log.records()[1:]) > BOUND  # the bound acted
    if prefill_first == "off":  # mixed: the decodes ride along in the bounded steps
        assert any(step.prompt_tokens == BOUND and step.decode_tokens for step in steps)
    for llm in (bounded, unbounded):
        assert_all_blocks_free(llm)
        llm.close()


@pytest.mark.parametrize("prefill_first", ["off", "on"])
def test_a_backlog_of_prompts_is_spread_over_prefill_backlog_steps_steps(ckpt, prefill_first):
    """Two sequences decode when 87 prompt tokens arrive: with prefill_backlog_steps=2 a step may take 44 of them
    (87 / 2 rounded up, more than the bound): the 40-token prompt and 4 of the 30-token one. Then 43 are left:
    half of that is less than the bound, which holds again (24), and the last 19 fit it. Prefill first changes
    nothing here: no waiting prompt is short enough for a step of its own beside two or three decodes."""
    options = dict(max_num_batched_tokens=512, prefill_first=prefill_first, max_prefill_tokens_while_decoding=BOUND)
    spread = make_llm(ckpt, prefill_backlog_steps=2, **options)
    strict = make_llm(ckpt, prefill_backlog_steps=0, **options)
    assert run_with_late_prompts(spread) == run_with_late_prompts(strict)
    assert prompt_steps(spread) == [(44, 2), (BOUND, 3), (19, 3)]  # the 40-token prompt decodes from the second
    assert all(step.prompt_tokens <= BOUND for step in strict.engine.step_log.records()[1:])
    for llm in (spread, strict):
        assert_all_blocks_free(llm)
        llm.close()


def test_a_backlog_never_takes_more_than_the_step_budget(ckpt):
    """prefill_backlog_steps=1 would take all 87 waiting tokens at once; the step budget (48, 2 of them decodes)
    still caps it, and the 41 left then fit one step whole."""
    llm = make_llm(ckpt, max_num_batched_tokens=48, prefill_first="off", max_prefill_tokens_while_decoding=BOUND,
                   prefill_backlog_steps=1)
    run_with_late_prompts(llm)
    assert prompt_steps(llm) == [(46, 2), (41, 3)]
    assert_all_blocks_free(llm)
    llm.close()


def test_the_backlog_rule_takes_a_whole_number_of_steps():
    assert EngineConfig().prefill_backlog_steps == 0  # off: the bound always holds
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefill_backlog_steps"):
            EngineConfig(prefill_backlog_steps=bad)


def test_the_bound_needs_chunked_prefill_and_is_not_negative(ckpt):
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        make_llm(ckpt, max_prefill_tokens_while_decoding=-1)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        make_llm(ckpt, max_prefill_tokens_while_decoding=64, enable_chunked_prefill=False)


def test_the_engine_bounds_steps_beside_decodes_on_cuda_by_default(ckpt):
    """Issue 27: on CUDA, while sequences decode, a step takes at most CUDA_PREFILL_BOUND prompt tokens unless the
    config says otherwise; on CPU no bound by default (the serving default is SERVING_PREFILL_BOUND, below)."""
    auto = EngineConfig()
    assert auto.prefill_bound_on("cuda") == CUDA_PREFILL_BOUND and auto.prefill_bound_on("cpu") == 0
    assert EngineConfig(enable_chunked_prefill=False).prefill_bound_on("cuda") == 0  # nothing to split prompts by
    assert EngineConfig(max_prefill_tokens_while_decoding=0).prefill_bound_on("cuda") == 0
    assert EngineConfig(max_prefill_tokens_while_decoding=96).prefill_bound_on("cpu") == 96
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        EngineConfig(max_prefill_tokens_while_decoding=1.5)
    with make_llm(ckpt) as llm:  # what the engine's scheduler was given on this machine's device
        assert llm.engine.scheduler.prefill_bound == auto.prefill_bound_on(llm.engine.device.type)
    with make_llm(ckpt, max_prefill_tokens_while_decoding=BOUND) as llm:
        assert llm.engine.scheduler.prefill_bound == BOUND


def test_the_step_log_summary_splits_decode_only_steps_from_steps_with_prompts():
    log = StepLog(capacity=3)
    assert log.summary() == "engine steps: none" and log.last() is None
    log.record(StepRecord(0.0, 0.9, 1.0, prompt_tokens=0, decode_tokens=5, prompts=0))  # pushed out: capacity 3
    log.record(StepRecord(10.0, 0.9, 1.0, prompt_tokens=512, decode_tokens=0, prompts=1))
    log.record(StepRecord(11.5, 0.09, 0.1, prompt_tokens=0, decode_tokens=8, prompts=0))
    log.record(StepRecord(11.6, 0.5, 0.6, prompt_tokens=100, decode_tokens=8, prompts=2))
    summary = log.summary()
    assert len(log.records()) == 3 and log.last() == log.records()[-1] and log.last().prompts == 2
    assert summary.startswith("engine steps: 3 over 2.2 s, busy 77%")
    assert "decode-only 1: p50 100.0 ms" in summary and "batch 8.0 mean" in summary
    assert "with prompts 2:" in summary and "prompt tokens p50 306 max 512; with decodes too 1, prompt tokens max 100" \
        in summary
    assert "gaps between steps p50 250.0 ms" in summary


def test_tandem_serve_bounds_the_prompt_tokens_of_steps_beside_decodes_by_default():
    import argparse

    from cluster.serve import add_arguments
    from cluster.serve_flags import SERVING_PREFILL_BOUND, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def bound(*flags: str) -> int:
        return engine_config_from_args(parser.parse_args(list(flags))).max_prefill_tokens_while_decoding

    assert bound("--device", "cpu") == SERVING_PREFILL_BOUND
    assert bound("--device", "cuda") == SERVING_PREFILL_BOUND  # decodes keep flowing beside a long prompt there too
    assert bound("--device", "cpu", "--max-prefill-tokens-while-decoding", "0") == 0
    assert bound("--device", "cpu", "--max-prefill-tokens-while-decoding", "128") == 128
    backlog = engine_config_from_args(parser.parse_args(["--prefill-backlog-steps", "4"])).prefill_backlog_steps
    assert backlog == 4 and engine_config_from_args(parser.parse_args([])).prefill_backlog_steps == 0
