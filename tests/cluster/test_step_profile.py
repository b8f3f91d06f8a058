"""`tandem bench engine --profile-steps` and the limits table's prefill and mixed rows on CPU: what a GPU host runs
to see where a step's time goes (cluster/bench/step_profile.py), shaped as the GPU run reads it; timings are not
checked."""
from __future__ import annotations

from cluster.bench.limits import mixed_row, prefill_row
from cluster.bench.step_profile import profile_steps
from tests.support.engine_checks import assert_all_blocks_free
from tests.support.engines import make_llm


def test_each_kind_of_step_is_profiled_and_nothing_is_left_running():
    with make_llm("tiny", device="cpu") as llm:
        profiles = profile_steps(llm, top=5)
        assert [p.phase for p in profiles] == ["prefill 8 x 256", "decode b=1", "decode b=32", "mixed 32d + 512"]
        assert [p.steps for p in profiles] == [1, 8, 8, 1]
        for profile in profiles:
            assert profile.kernels > 0 and profile.busy_ms > 0 and 0 < len(profile.top) <= 5
            assert all(name.startswith("aten::") and count > 0 for name, count, _ in profile.top)
            assert profile.runtime == {}  # no CUDA runtime calls on a CPU
            assert profile.wall_ms > 0 and 0 < len(profile.python) <= 5  # the host's side, from cProfile
            assert all(calls > 0 and ms >= 0 for _, calls, ms in profile.python)
        by_phase = {p.phase: p for p in profiles}
        assert by_phase["mixed 32d + 512"].kernels > by_phase["decode b=32"].kernels  # the chunk's prefill ops too
        heaviest_prefill = by_phase["prefill 8 x 256"].python[0][0]  # the matmuls and attention of 2,048 tokens
        assert "linear" in heaviest_prefill or "attention" in heaviest_prefill or "mm" in heaviest_prefill
        assert_all_blocks_free(llm)


def test_the_prefill_row_takes_its_host_time_from_the_step_log():
    with make_llm("tiny", device="cpu") as llm:
        row = prefill_row(llm, prompts=2, length=32, repeats=1)
        assert row.phase == "prefill" and row.batch == "2 x 32 tokens"
        assert row.host_ms > 0 and row.device_ms is None  # no device time off CUDA
        assert_all_blocks_free(llm)


def test_the_mixed_row_times_decodes_beside_a_chunk_against_decodes_alone():
    with make_llm("tiny", device="cpu") as llm:
        row = mixed_row(llm, decodes=4, chunk=48, repeats=2)
        assert row.phase == "mixed step" and row.batch == "4 dec + 48 prompt"
        assert row.engine_ms > 0 and row.floor_ms > 0 and "decode step of 4" in row.floor
        assert row.host_ms > 0 and row.device_ms is None  # the host's issue time from the step log; no device
        assert_all_blocks_free(llm)
