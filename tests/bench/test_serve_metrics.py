"""`tandem bench serve` arithmetic on hand-made timestamps, workload generation and arrival gaps."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from aiohttp import web

from cluster.bench.serve_client import ClientConfig, run_requests
from cluster.bench.serve_metrics import RequestResult, compute_metrics, parse_goodput
from cluster.bench.serve_workloads import (MixedWorkload, PrefixRepetitionWorkload, RandomWorkload, SampleRequest,
                                           arrival_gaps, fit_to_context, generate_requests)

# A: sent at 0, chunks at 0.1 (1 token), 0.3 (2 tokens), 0.4 (1 token): 4 tokens.
# B: sent at 1, one chunk at 1.2 (1 token). C: failed.
A = RequestResult(True, 10, 0.0, (0.1, 0.3, 0.4), (1, 2, 1),
                  timing={"queue_ms": 10, "prefill_ms": 40, "transfer_ms": 25, "transfer_exposed_ms": 5,
                          "kv_bytes": 2_000_000})
B = RequestResult(True, 20, 1.0, (1.2,), (1,),
                  timing={"queue_ms": 30, "prefill_ms": 60, "transfer_ms": 50, "transfer_exposed_ms": 20,
                          "kv_bytes": 4_000_000})
C = RequestResult(False, 30, 2.0, error="HTTP 500")


def test_latency_metrics_follow_vllm_definitions():
    metrics = compute_metrics([A, B, C], duration=2.0)
    assert (metrics.completed, metrics.failed) == (2, 1)
    assert (metrics.total_input_tokens, metrics.total_output_tokens) == (30, 5)
    assert metrics.ttft.mean == pytest.approx(150) and metrics.ttft.median == pytest.approx(150)
    assert metrics.ttft.std == pytest.approx(50) and metrics.ttft.p90 == pytest.approx(190)
    assert metrics.ttft.p99 == pytest.approx(199)
    assert metrics.tpot.mean == pytest.approx(100)  # only A: (400 - 100) / (4 - 1)
    assert metrics.itl.mean == pytest.approx(150) and metrics.itl.p99 == pytest.approx(199)  # gaps 200, 100
    assert metrics.e2el.mean == pytest.approx(300)  # 400 and 200
    assert metrics.request_throughput == pytest.approx(1.0)
    assert metrics.output_throughput == pytest.approx(2.5)
    assert metrics.total_token_throughput == pytest.approx(17.5)
    assert metrics.request_goodput is None


def test_goodput_counts_requests_meeting_every_slo():
    assert compute_metrics([A, B, C], 2.0, parse_goodput(["ttft:150"])).request_goodput == pytest.approx(0.5)
    assert compute_metrics([A, B], 2.0, parse_goodput(["ttft:250", "tpot:101"])).request_goodput == 1.0
    assert compute_metrics([A, B], 2.0, parse_goodput(["e2el:300"])).request_goodput == pytest.approx(0.5)
    for bad in (["foo:1"], ["ttft"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_disagg_breakdown_and_transfer_share_of_ttft():
    disagg = compute_metrics([A, B, C], 2.0).disagg
    assert disagg.requests_with_timing == 2
    assert disagg.queue_ms_p50 == pytest.approx(20) and disagg.prefill_ms_p99 == pytest.approx(59.8)
    assert disagg.transfer_ms_p50 == pytest.approx(37.5) and disagg.mean_kv_bytes == 3_000_000
    assert disagg.transfer_gb_per_s == pytest.approx(6e6 / 0.075 / 1e9)
    assert disagg.transfer_exposed_ms_p50 == pytest.approx(12.5)
    # the share of TTFT the client waited for the transfer: exposed 5 of 100 ms (A), 20 of 200 ms (B)
    assert disagg.transfer_share_of_ttft_p50 == pytest.approx(0.075)


def test_random_workload_lengths_range_and_seed():
    fixed = generate_requests(RandomWorkload(32, 8), 20, 256, seed=1)
    assert all(len(r.prompt_token_ids) == 32 and r.output_len == 8 for r in fixed)
    assert all(0 <= token < 256 for r in fixed for token in r.prompt_token_ids)
    ranged = generate_requests(RandomWorkload(100, 10, 0.5), 200, 7, seed=1)
    lengths = [len(r.prompt_token_ids) for r in ranged]
    assert 50 <= min(lengths) < 60 and 140 < max(lengths) <= 150
    assert all(5 <= r.output_len <= 15 for r in ranged) and max(t for r in ranged for t in r.prompt_token_ids) == 6
    assert generate_requests(RandomWorkload(100, 10, 0.5), 200, 7, seed=1) == ranged
    assert generate_requests(RandomWorkload(100, 10, 0.5), 200, 7, seed=2) != ranged


def test_requests_are_cut_to_fit_the_served_context():
    requests = [SampleRequest(tuple(range(10)), 4), SampleRequest(tuple(range(30)), 4),
                SampleRequest(tuple(range(5)), 40), SampleRequest(tuple(range(16)), 4)]
    fitted, cut = fit_to_context(requests, 20)
    assert cut == 2
    assert fitted[0] == requests[0] and fitted[3] == requests[3]          # 16 + 4 fits exactly
    assert fitted[1] == SampleRequest(tuple(range(16)), 4)               # the prompt loses its end
    assert fitted[2] == SampleRequest((0,), 19)                          # the output alone left no room
    assert all(len(r.prompt_token_ids) + r.output_len <= 20 for r in fitted)
    with pytest.raises(ValueError, match="holds no prompt"):
        fit_to_context(requests, 1)


def test_prefix_repetition_shares_prefixes_and_mixed_shares_long_prompts():
    requests = generate_requests(PrefixRepetitionWorkload(16, 4, 3, 5), 12, 256, seed=0)
    prefixes = {r.prompt_token_ids[:16] for r in requests}
    assert len(prefixes) == 3 and all(len(r.prompt_token_ids) == 20 and r.output_len == 5 for r in requests)
    assert len({r.prompt_token_ids[16:] for r in requests}) == 12
    mixed = generate_requests(MixedWorkload(0.25, 64, 8, 4), 20, 256, seed=0)
    assert sorted(len(r.prompt_token_ids) for r in mixed) == [8] * 15 + [64] * 5
    with pytest.raises(ValueError):
        generate_requests(MixedWorkload(1.5, 64, 8, 4), 20, 256, seed=0)


def test_gamma_arrivals_have_mean_gap_one_over_rate():
    for burstiness in (1.0, 0.5, 4.0):
        gaps = arrival_gaps(20_000, 8.0, burstiness, seed=3)
        assert np.mean(gaps) == pytest.approx(1 / 8, rel=0.03)
    assert arrival_gaps(3, float("inf"), 1.0, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0, 1.0, seed=0)


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "m"}]})


async def _flaky_completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["prompt"][0] % 2:
        return web.json_response({"error": {"message": "boom"}}, status=500)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"token_ids": [1, 2], "finish_reason": "length"}],'
                         b' "tandem_timing": {"queue_ms": 1}}\n\ndata: [DONE]\n\n')
    return response


def test_server_errors_count_as_failed_and_the_run_goes_on():
    async def scenario():
        app = web.Application()
        app.router.add_get("/v1/models", _models)
        app.router.add_post("/v1/completions", _flaky_completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        samples = [SampleRequest((token,), 2) for token in range(6)]
        try:
            return await run_requests(ClientConfig(f"http://127.0.0.1:{port}", max_concurrency=2), samples,
                                      [0.0] * 6, [])
        finally:
            await runner.cleanup()
    model, results, duration = asyncio.run(scenario())
    metrics = compute_metrics(results, duration)
    assert model == "m" and (metrics.completed, metrics.failed, metrics.total_output_tokens) == (3, 3, 6)
    assert "HTTP 500" in [r for r in results if not r.success][0].error
