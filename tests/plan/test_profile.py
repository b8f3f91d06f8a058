"""The planner's engine side: SimEngine picks the chunks the real Scheduler picks, the profile measures every
grid point on a real engine (the tiny checkpoint) and leaves its pool whole, and the fitted step model is a
monotone, positive curve that survives a save and a load. No timing is asserted."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from cluster.plan.engine_sim import EngineLimits, SimEngine, SimSequence, step_work
from cluster.plan.profile import (EngineProfile, MeasuredStep, ProfileGrid, measure_decode, measure_mixed,
                                  measure_prefill, measure_step, warm_up)
from cluster.plan.step_model import FEATURES, StepTimeModel, StepWork, fit_step_model
from engine import SamplingParams
from engine.builder import build_engine
from engine.config import EngineConfig

TINY_GRID = ProfileGrid(prefill=((1, 8), (3, 24), (1, 100)), decode_batches=(1, 4), decode_contexts=(16, 64),
                        mixed=((2, 16, 40),), decode_steps=2, repeats=1)


def _engine(tiny_checkpoint, budget: int, threshold: int, max_seqs: int = 256, prefill_first: str = "off"):
    config = EngineConfig(max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
                          max_num_seqs=max_seqs, kv_cache_memory=4 << 20, prefill_first=prefill_first)
    return build_engine(str(tiny_checkpoint("llama")), config, device="cpu")


def _assert_pool_whole(engine) -> None:
    assert engine.num_live_requests == 0, "requests still live in the engine"
    assert engine.num_free_blocks == engine.num_total_blocks, "KV blocks leaked"


def _normal(work: StepWork) -> StepWork:
    return StepWork(tuple(sorted(work.prefill_chunks)), tuple(sorted(work.decode_contexts)))


@pytest.mark.parametrize("prefill_first", ["off", "on"])
def test_the_simulated_engine_schedules_the_chunks_the_real_scheduler_does(tiny_checkpoint, prefill_first):
    engine = _engine(tiny_checkpoint, budget=32, threshold=12, max_seqs=3, prefill_first=prefill_first)
    rng = random.Random(3)
    vocab = engine.model_config.vocab_size
    sim = SimEngine(EngineLimits(32, 12, 3, prefill_first=prefill_first == "on"))
    blocks = engine.reserve_blocks(2)  # a request whose KV a transfer delivered, already decoding
    engine.add_prefilled_request("prefilled", [rng.randrange(vocab) for _ in range(20)], 5,
                                 SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), blocks)
    sim.add_running(SimSequence(-1, 20, 5, num_computed=20, num_generated=1))
    cases = [(50, 3), (10, 2), (30, 4), (5, 1), (70, 2), (1, 3)]
    for index, (prompt_len, output_len) in enumerate(cases):
        engine.add_request(f"r{index}", [rng.randrange(vocab) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
        sim.add_waiting(SimSequence(index, prompt_len, output_len))
    ids = ["prefilled", *(f"r{index}" for index in range(len(cases)))]
    real = []
    while engine.has_unfinished_requests():
        real.append(_normal(measure_step(engine, ids).work))
    simulated = []
    while sim.has_work:
        chunks = sim.schedule()
        simulated.append(_normal(step_work(chunks)))
        sim.finish_step(chunks)
    assert simulated == real
    if prefill_first == "off":  # the case mixes both kinds
        assert any(len(w.prefill_chunks) > 1 and w.decode_contexts for w in real)
    else:  # prompts one step finishes in steps of their own while others decode; longer ones mixed
        assert any(w.prefill_chunks and not w.decode_contexts for w in real[1:])
        assert any(w.prefill_chunks and w.decode_contexts for w in real)
    _assert_pool_whole(engine)


@pytest.fixture(scope="module")
def measured(tiny_checkpoint) -> list[MeasuredStep]:
    """The tiny grid measured on a prefill worker's and a decode worker's engine (pools checked whole)."""
    steps = []
    for measurements in ((measure_prefill,), (measure_decode, measure_mixed)):
        engine = _engine(tiny_checkpoint, budget=64, threshold=32)
        warm_up(engine)
        for measure in measurements:
            steps += measure(engine, TINY_GRID)
        _assert_pool_whole(engine)
    return steps


def test_the_profile_measures_every_grid_point_with_what_each_step_computed(measured):
    points = {(s.phase, s.point) for s in measured}
    assert points == {("prefill", "1x8"), ("prefill", "3x24"), ("prefill", "1x100"), ("decode", "1x16"),
                      ("decode", "1x64"), ("decode", "4x16"), ("decode", "4x64"), ("mixed", "2x16+40")}
    assert all(math.isfinite(s.seconds) and s.seconds > 0 for s in measured)
    long_prompt = [s.work for s in measured if s.point == "1x100"]
    assert long_prompt == [StepWork(((32, 0),)), StepWork(((32, 32),)), StepWork(((32, 64),)), StepWork(((4, 96),))]
    # three 24-token prompts in a 64-token budget: the third gets what is left, then the rest
    assert [s.work for s in measured if s.point == "3x24"] == [StepWork(((24, 0), (24, 0), (16, 0))),
                                                               StepWork(((8, 16),))]
    assert [s.work.decode_contexts for s in measured if s.point == "4x64"] == [(65,) * 4, (66,) * 4]
    mixed = [s.work for s in measured if s.phase == "mixed"]
    assert [w.prefill_chunks for w in mixed] == [((32, 0),), ((8, 32),)] and all(len(w.decode_contexts) == 2
                                                                                 for w in mixed)


def test_the_fitted_step_model_is_a_positive_monotone_curve_that_survives_save_and_load(measured):
    profile = EngineProfile("tiny", "cpu", "float32", 1, 1024, 16, 4096, tuple(measured))
    model = profile.fit()
    assert all(c >= 0 for c in model.coefficients) and model.seconds(StepWork(((1, 0),))) > 0
    prefill = [model.seconds(StepWork(((n, 0),))) for n in (1, 16, 64, 256, 1024)]
    decode_by_batch = [model.seconds(StepWork((), (128,) * b)) for b in (1, 4, 16, 64)]
    decode_by_context = [model.seconds(StepWork((), (c,) * 8)) for c in (16, 128, 1024)]
    for curve in (prefill, decode_by_batch, decode_by_context):
        assert curve == sorted(curve) and curve[0] > 0
    assert EngineProfile.from_dict(profile.as_dict()) == profile
    with pytest.raises(ValueError, match="not a saved `tandem plan` profile"):
        EngineProfile.from_dict({"steps": [{"phase": "decode"}]})


def test_the_fit_recovers_known_coefficients_stays_non_negative_and_ignores_steps_slowed_by_others():
    rng = np.random.default_rng(0)
    truth = StepTimeModel((0.002, 1e-4, 5e-4, 1e-7, 3e-4, 1e-6))
    works = [StepWork(tuple((int(n), int(s)) for n, s in zip(rng.integers(1, 300, k), rng.integers(0, 900, k))),
                      tuple(int(c) for c in rng.integers(1, 2000, b)))
             for k, b in zip(rng.integers(0, 4, 60), rng.integers(0, 40, 60)) if k or b]
    seconds = [truth.seconds(w) for w in works]
    assert fit_step_model(works, seconds).coefficients == pytest.approx(truth.coefficients, rel=1e-6)
    slowed = [s * 3 if i % 10 == 0 else s for i, s in enumerate(seconds)]  # another process took the core
    assert fit_step_model(works, slowed).coefficients == pytest.approx(truth.coefficients, rel=1e-6)
    # a time that falls with more tokens: least squares would give the tokens a negative cost
    falling = fit_step_model([StepWork(((10, 0),)), StepWork(((20, 0),)), StepWork(((30, 0),))], [0.3, 0.2, 0.1])
    assert all(c >= 0 for c in falling.coefficients) and len(falling.coefficients) == len(FEATURES)
    with pytest.raises(ValueError):
        fit_step_model([StepWork(((1, 0),))], [0.0])
