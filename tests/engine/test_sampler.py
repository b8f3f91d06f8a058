"""Sampler on CPU: seeded draws independent of the batch, the top-k / top-p cuts against transformers'
warpers, goodness of fit of the draws (chi-square), edge values, greedy = argmax."""
from __future__ import annotations

import warnings

import pytest
import torch

from engine.sampling.draw import argmax
from engine.sampling.sampler import Sampler, sampling_probs
from engine.sampling_params import SamplingParams as SP
from tests.support.engine_checks import real_syncs
from tests.support.launch_count import LaunchCounter

VOCAB = 3000  # two full blocks of the two-level draw and a short third one
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
SEEDED = [SP(temperature=1.3, seed=7), SP(temperature=0.8, top_k=40, seed=8),
          SP(temperature=1.1, top_p=0.9, seed=9), SP(temperature=1.2, top_k=300, top_p=0.95, seed=10)]


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2  # [rows, vocab]


def _sample(logits, params, positions=None, seed: int = 0) -> list[int]:
    positions = list(range(100, 100 + len(params))) if positions is None else positions
    return Sampler(seed)(logits, params, positions)


def test_seeded_row_draws_the_same_token_whatever_the_batch():
    row = _logits(1, seed=1)
    others = _logits(6, seed=2)
    fillers = [SP(temperature=0), SP(), SP(top_k=5, seed=3), SP(top_p=0.5), SP(temperature=0.5, top_k=9000),
               SP(top_k=2, top_p=0.3, seed=4)]
    for params in SEEDED:
        alone = _sample(row, [params], [57])[0]
        for at in (0, 3, 6):
            batch = torch.cat([others[:at], row, others[at:]])  # [7, vocab]
            mixed = fillers[:at] + [params] + fillers[at:]
            positions = [11] * at + [57] + [12] * (6 - at)
            for sampler_seed in (0, 123):
                assert _sample(batch, mixed, positions, seed=sampler_seed)[at] == alone, (params, at)
    distinct = {_sample(row, [SP(temperature=1.3, seed=s)], [57])[0] for s in range(20)}
    assert len(distinct) > 10  # the seed matters: not an argmax in disguise


def test_same_seed_different_positions_draw_independently():
    flat = torch.zeros(1, 1000)  # [1, vocab]: token = floor(u * 1000), so the token shows the uniform
    params = SP(seed=42)
    tokens = [_sample(flat, [params], [position])[0] for position in range(64)]
    assert len(set(tokens)) >= 60
    batch = _sample(flat.expand(64, -1), [params] * 64, list(range(64)))
    assert batch == tokens


def _reference_probs(logits: torch.Tensor, params: list[SP]) -> torch.Tensor:
    """transformers' temperature, top-k and top-p warpers, row by row, then softmax."""
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    rows = []
    for row, p in zip(logits, params):
        scores = logits_process.TemperatureLogitsWarper(p.temperature)(None, row[None].clone())
        if p.top_k > 0:
            scores = logits_process.TopKLogitsWarper(min(p.top_k, row.numel()))(None, scores)
        if p.top_p < 1.0:
            scores = logits_process.TopPLogitsWarper(p.top_p)(None, scores)
        rows.append(scores.softmax(dim=-1)[0])
    return torch.stack(rows)  # [R, vocab]


@pytest.mark.parametrize("vocab", [50, VOCAB])
def test_filtered_probabilities_match_transformers_warpers(vocab):
    params = [SP(), SP(temperature=0.6), SP(top_k=1), SP(top_k=7), SP(temperature=1.7, top_k=25),
              SP(top_p=0.1), SP(top_p=0.6), SP(temperature=0.5, top_p=0.95), SP(top_k=20, top_p=0.7),
              SP(temperature=2.0, top_k=vocab + 5, top_p=0.8), SP(top_k=vocab - 1), SP(top_p=1e-9)]
    logits = _logits(len(params), vocab, seed=5)
    logits[0, ::7] = float("-inf")
    expected = _reference_probs(logits, params)
    for batch in (params, *([p] for p in params)):  # mixed groups in one call, then each row alone
        rows = [params.index(p) for p in batch]
        got = sampling_probs(logits[rows], batch)
        torch.testing.assert_close(got, expected[rows], atol=1e-6, rtol=1e-4)
        assert torch.equal(got > 0, expected[rows] > 0)  # the same kept set


def _chi_square(logits: torch.Tensor, params: SP, draws: int, seeded: bool) -> tuple[float, int]:
    """The statistic and its degrees of freedom for `draws` samples of one row, against the reference."""
    expected = _reference_probs(logits, [params])[0] * draws  # [vocab]
    params = SP(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                seed=2024 if seeded else None)
    tokens = _sample(logits.expand(draws, -1), [params] * draws, list(range(draws)), seed=99)
    observed = torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).double()  # [vocab]
    kept = expected > 0
    assert observed[~kept].sum() == 0, "a token outside the kept set was drawn"
    assert (expected[kept] >= 5).all()  # the chi-square approximation holds
    statistic = float(((observed[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    return statistic, int(kept.sum()) - 1


EIGHT = torch.tensor([[2.0, 1.5, 1.2, 0.8, 0.5, 0.0, -0.5, -1.0]])  # [1, 8]


@pytest.mark.parametrize("params, seeded", [
    (SP(temperature=0.7), False), (SP(temperature=0.7), True), (SP(top_k=4), False),
    (SP(top_p=0.8), False), (SP(temperature=1.3, top_k=6, top_p=0.9), True)])
def test_draws_fit_the_filtered_distribution(params, seeded):
    statistic, dof = _chi_square(EIGHT, params, 20_000, seeded)
    assert statistic < CHI2_CRITICAL_P001[dof], (statistic, dof)


def test_draws_fit_across_blocks():
    spread = torch.full((1, VOCAB), float("-inf"))  # [1, vocab]: eight tokens around block edges
    spread[0, [5, 1023, 1024, 1500, 2047, 2048, 2500, 2999]] = EIGHT[0]
    statistic, dof = _chi_square(spread, SP(temperature=0.7), 20_000, seeded=False)
    assert dof == 7 and statistic < CHI2_CRITICAL_P001[dof], statistic


def test_edge_values_give_valid_tokens():
    logits = _logits(16, seed=6)
    logits[:, ::3] = float("-inf")
    logits[8:, 1:] = float("-inf")  # rows 8..15: only token 0 is possible
    argmax = logits.argmax(dim=-1)
    edge = [SP(temperature=1e-40), SP(temperature=1e6), SP(top_p=1e-9), SP(top_k=1),
            SP(top_k=VOCAB + 5), SP(temperature=1e6, top_k=VOCAB + 5, top_p=0.99), SP(temperature=1e-5),
            SP(temperature=1e6, seed=5)]
    for seed in range(5):
        tokens = _sample(logits, edge + edge, seed=seed)
        assert all(0 <= t < VOCAB and t % 3 != 0 for t in tokens[:8])  # never a -inf token
        for i in (0, 2, 3, 6):  # greedy, top token only, top-1, temperature 1e-5 with gaps of ~0.01+
            assert tokens[i] == argmax[i]
        assert tokens[8:] == [0] * 8


def test_rows_without_probability_mass_still_give_a_valid_token():
    logits = _logits(4, seed=7)
    logits[0] = float("-inf")
    logits[1, 10] = float("nan")
    logits[2, 20] = float("inf")
    logits[3] = 3e38  # over the float range once divided by a small temperature
    tokens = _sample(logits, [SP(), SP(top_k=5), SP(top_p=0.5), SP(temperature=1e-5)])
    assert all(0 <= t < VOCAB for t in tokens)
    assert tokens[2] == 20


@pytest.mark.parametrize("vocab", [7, 1024, 2048, VOCAB])
def test_greedy_batch_is_argmax(vocab):
    logits = _logits(33, vocab, seed=8)
    logits[0, :] = 1.0  # all tied: the first
    logits[1, [3, vocab - 1]] = 100.0  # tied maxima in different blocks: the first
    logits[2, vocab - 1] = 100.0  # in the last column (the short block, if any)
    tokens = _sample(logits, [SP(temperature=0)] * 33)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[:3] == [0, 3, vocab - 1]


def test_the_greedy_pick_off_the_cpu_is_one_argmax():
    """The two-level argmax is a CPU speed-up; on a GPU its 12 ops would be launches after every decode graph's
    replay. Counted on the meta device (as a GPU would be): torch's one argmax; on CPU: the two levels, same ids."""
    counter = LaunchCounter()
    counter.counting = True
    with counter:
        argmax(torch.empty(4, VOCAB, device="meta"))
    assert dict(counter.torch_ops) == {"argmax": 1}, counter.torch_ops
    logits = _logits(4, seed=3)
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))


def test_empty_batch():
    assert _sample(torch.zeros(0, VOCAB), []) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_one_sync_and_seeded_rows_match_across_batches():
    logits = _logits(6, seed=9).cuda()  # [6, vocab]
    params = [SP(temperature=0), SP(), SP(top_k=50), SP(top_p=0.9), SP(top_k=50, top_p=0.9), SEEDED[1]]
    sampler = Sampler(0)
    sampler(logits, params, list(range(6)))  # warm: generators, kernels
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            tokens = sampler(logits, params, list(range(6)))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = real_syncs(caught)
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert tokens[0] == logits[0].argmax().item()
    assert sampler(logits[5:], params[5:], [5])[0] == tokens[5]


def test_plain_rows_take_the_fast_paths():
    """No row asks for a processor: the logits are not copied; none asks for logprobs: none come back."""
    from engine.sampling.logits_processors import process_logits

    logits = _logits(3)
    params = [SP(temperature=0), SP(top_k=5), SP(min_tokens=0, stop_token_ids=[3])]
    assert process_logits(logits, params, [([1, 2], 2)] * 3) is logits
    out = Sampler(0).sample(logits, params, [5, 6, 7], [([1, 2], 2)] * 3)
    assert out.logprobs == [None] * 3 and out.tokens[0] == logits[0].argmax().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_processors_and_logprobs_keep_one_sync():
    logits = _logits(5, seed=10).cuda()  # [5, vocab]
    params = [SP(temperature=0, repetition_penalty=1.3, logprobs=5), SP(presence_penalty=0.5, logprobs=0, seed=4),
              SP(logit_bias={7: 5.0}, min_tokens=3, stop_token_ids=[9], seed=3), SP(min_p=0.1, logprobs=20, seed=5),
              SP(frequency_penalty=-0.5, top_k=40)]
    histories = [([1, 2, 3, 2, 1], 3)] * 5
    sampler = Sampler(0, eos_token_ids=[11])
    on_cpu = sampler.sample(logits.cpu(), params, list(range(5)), histories)
    # Seeded rows draw alike on one device (CUDA's generator is not the CPU's): the reference is an earlier
    # call on the same device, which also warms the generators and kernels.
    expected = sampler.sample(logits, params, list(range(5)), histories)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = sampler.sample(logits, params, list(range(5)), histories)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = real_syncs(caught)
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert out.tokens[0] == on_cpu.tokens[0] and out.tokens[1:4] == expected.tokens[1:4]
    assert on_cpu.logprobs[0].top_ids == out.logprobs[0].top_ids  # the greedy row's alternatives, as on the CPU
    for got, want in zip(out.logprobs, expected.logprobs):
        assert (got is None) == (want is None)
        if got is not None:
            assert got.top_ids == want.top_ids and abs(got.logprob - want.logprob) < 1e-4


def test_top_p_candidates_climb_the_ladder_and_cut_as_a_full_sort_would():
    """top-p alone on a 40k vocabulary: a peaked row's nucleus sits in the first rung's partial sort, a
    flatter one's in the second, a near-flat one needs the full sort. Each row's kept probabilities equal
    transformers' warpers whether it comes alone or with the others, and a seeded row draws the same token
    either way."""
    from engine.sampling.nucleus import NUCLEUS_LADDER, nucleus_candidates

    vocab = 40000
    generator = torch.Generator().manual_seed(3)
    logits = torch.stack([torch.randn(vocab, generator=generator) * scale for scale in (8.0, 2.5, 0.3)])
    params = [SP(top_p=0.9, seed=1), SP(top_p=0.9, seed=2), SP(top_p=0.9, seed=3)]
    widths = [nucleus_candidates(logits[i:i + 1], [0.9])[0].shape[-1] for i in range(3)]
    assert widths == [NUCLEUS_LADDER[0], NUCLEUS_LADDER[1], vocab]
    expected = _reference_probs(logits, params)
    together = sampling_probs(logits, params)
    torch.testing.assert_close(together, expected, atol=1e-6, rtol=1e-4)
    assert torch.equal(together > 0, expected > 0)
    for i in range(3):
        torch.testing.assert_close(sampling_probs(logits[i:i + 1], params[i:i + 1]), expected[i:i + 1],
                                   atol=1e-6, rtol=1e-4)
    batch = _sample(logits, params, [40, 41, 42])
    assert batch == [_sample(logits[i:i + 1], [params[i]], [40 + i])[0] for i in range(3)]
