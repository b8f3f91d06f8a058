"""Issue 27's budget: at most 10 launches per decoder layer in a decode step on the Triton path (fused RMSNorm
with the residual add, RoPE with the K/V store, SiLU x up, two for the paged decode), counted on CPU (the same
forward under Triton's interpreter; on a GPU host, on the GPU), torch ops counted with a dispatch mode, Triton
launches with a counting wrapper (tests/support/launch_count.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
from engine import SamplingParams  # noqa: E402
from engine.attention import triton_decode, triton_prefill, triton_store  # noqa: E402
from engine.model import fused_triton  # noqa: E402
from tests.support.engines import TEST_DEVICE, make_llm  # noqa: E402
from tests.support.launch_count import LaunchCounter  # noqa: E402

MAX_LAUNCHES_PER_LAYER = 10


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_decode_steps_layers_take_at_most_ten_launches_each(arch, tiny_checkpoint):
    llm = make_llm(str(tiny_checkpoint(arch)), dtype="float32", device=TEST_DEVICE.type, attention_backend="triton",
                   enforce_eager=True)
    engine, layers = llm.engine, llm.engine.runner.model.layers
    engine.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # the prefill
    counter = LaunchCounter()

    def enter(*_):
        counter.counting = True

    def leave(*_):
        counter.counting = False
    hooks = [h for layer in layers
             for h in (layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave))]
    try:
        with counter, counter.triton_launches(fused_triton, triton_decode, triton_store, triton_prefill):
            engine.step()  # one decode row
    finally:
        for hook in hooks:
            hook.remove()
    per_layer = counter.total / len(layers)
    assert counter.triton["_rotary_store_kernel"] == len(layers) and counter.triton["_merge_kernel"] == len(layers)
    assert per_layer <= MAX_LAUNCHES_PER_LAYER, (per_layer, dict(counter.torch_ops), dict(counter.triton))
    llm.close()


def test_a_steps_layers_share_one_decode_plan(tiny_checkpoint, monkeypatch):
    """The decode rows' partition size and partial buffers are made once per step, not once per layer (host time
    a GPU step would otherwise pay per layer: two allocations, two slices, the sizing). A mixed step whose decode
    rows are short makes none: they go through the prefill kernel with the prompt (one launch a layer)."""
    llm = make_llm(str(tiny_checkpoint("llama")), dtype="float32", device=TEST_DEVICE.type, attention_backend="triton",
                   enforce_eager=True)
    engine, made = llm.engine, []
    make_scratch = triton_decode.decode_scratch
    monkeypatch.setattr(triton_decode, "decode_scratch",
                        lambda *args, **kw: made.append(args) or make_scratch(*args, **kw))
    engine.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # the prefill: no decode row
    engine.step()  # a decode step
    assert len(engine.runner.model.layers) > 1 and len(made) == 1 and made[0][0] == 1, made  # one row, one plan
    engine.add_request("p", list(range(10, 40)), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    counter = LaunchCounter()
    with counter, counter.triton_launches(triton_decode, triton_prefill):
        counter.counting = True
        engine.step()  # a mixed step: the decode row beside the prompt
    assert len(made) == 1 and counter.triton == {"_prefill_kernel": len(engine.runner.model.layers)}, counter.triton
    llm.close()
