"""Structured outputs in the engine: whatever a tiny random-weight model would say, constrained output parses and
validates against its JSON schema (jsonschema; the schemas bound their numbers and strings, which an
untrained model would otherwise extend to max_tokens), matches its regex, is one of its choices or follows its grammar;
unconstrained requests in the same batch are token-for-token unchanged; n > 1, seeds, stop strings, logprobs,
preemption and the prefill -> decode hand-off keep working; bad specs are ValueErrors before anything runs."""
from __future__ import annotations

import json
import math
import re
import threading
import warnings

import jsonschema
import pytest
import torch

from engine import SamplingParams, StructuredOutputsParams
from engine.sampling.sampler import Sampler
from engine.sampling.token_mask import apply_token_masks
from tests.support.engine_checks import assert_all_blocks_free, random_prompts, real_syncs
from tests.support.engines import make_llm

VOCAB = 300
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]}},
     "required": ["name", "age", "color"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                                   "y": {"type": "boolean"}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 2, "maxItems": 3}},
     "required": ["point", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"ok": {"const": True},
                                                                 "n": {"type": "integer", "minimum": -9, "maximum": 9}},
                                "required": ["ok"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(ckpt):
    with make_llm(str(ckpt), block_size=8) as llm:
        yield llm


def constrained(max_tokens: int = 120, **spec) -> dict:
    return {"max_tokens": max_tokens, "structured_outputs": StructuredOutputsParams(**spec)}


def run(llm, prompts, params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat-enum", "nested-array", "array-of-objects"])
def test_json_schema_output_validates_greedy_and_sampled(llm, schema):
    prompts = random_prompts([5, 17, 9, 30], VOCAB, seed=1)
    params = [SamplingParams(temperature=0, **constrained(json=schema))] + \
             [SamplingParams(temperature=t, seed=s, **constrained(json=schema))
              for t, s in ((0.7, 1), (1.0, 2), (1.3, 3))]
    for output in run(llm, prompts, params):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)
    assert_all_blocks_free(llm)


def test_json_object_regex_choice_and_grammars(llm):
    lark = 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/ | "x"\n'
    gbnf = 'root ::= "go " dir\ndir ::= "north" | "south" | "east"\n'
    specs = [dict(json_object=True), dict(regex=r"[a-f]{3}-[0-9]{2,4}"),
             dict(choice=["yes", "no", "a \"quoted\" maybe"]), dict(grammar=lark), dict(grammar=gbnf)]
    prompts = random_prompts([7] * len(specs), VOCAB, seed=2)
    outs = run(llm, prompts, [SamplingParams(temperature=1.0, seed=4, **constrained(**s)) for s in specs])
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert isinstance(json.loads(texts[0]), dict)
    assert re.fullmatch(r"[a-f]{3}-[0-9]{2,4}", texts[1])
    assert texts[2] in ("yes", "no", 'a "quoted" maybe')
    assert re.fullmatch(r"\((?:[0-9]{1,2}|x)(?:,(?:[0-9]{1,2}|x))*\)", texts[3])
    assert texts[4] in ("go north", "go south", "go east")


def test_unconstrained_rows_in_the_same_batch_are_unchanged(llm):
    prompts = random_prompts([11, 6, 14, 9], VOCAB, seed=3)
    plain = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True, logprobs=2)]
    alone = run(llm, prompts[:2], plain)
    mixed = run(llm, prompts, plain + [SamplingParams(temperature=0.8, seed=1, **constrained(json=SCHEMAS[0])),
                                       SamplingParams(temperature=0, **constrained(regex="[0-9]+"))])
    for a, m in zip(alone, mixed[:2]):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
    for got, want in zip(mixed[1].outputs[0].logprobs, alone[1].outputs[0].logprobs):
        assert got.keys() == want.keys() and all(abs(got[t].logprob - want[t].logprob) < 1e-5 for t in got)
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), SCHEMAS[0])


def test_n_samples_with_seeds_each_follow_the_grammar_and_match_single_requests(llm):
    prompt = random_prompts([10], VOCAB, seed=5)
    params = SamplingParams(n=3, temperature=1.0, seed=21, **constrained(json=SCHEMAS[1]))
    [output] = run(llm, prompt, params)
    for j, sample in enumerate(output.outputs):
        jsonschema.validate(json.loads(sample.text), SCHEMAS[1])
        single = SamplingParams(temperature=1.0, seed=21 + j, **constrained(json=SCHEMAS[1]))
        assert run(llm, prompt, single)[0].outputs[0].token_ids == sample.token_ids
    assert len({s.text for s in output.outputs}) > 1
    assert_all_blocks_free(llm)


def test_logprobs_are_those_of_the_masked_distribution(llm):
    prompt = random_prompts([8], VOCAB, seed=6)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=1.0, seed=3, logprobs=5, **constrained(choice=["yes", "no"]))
    completion = run(llm, prompt, params)[0].outputs[0]
    assert completion.text in ("yes", "no") and completion.token_ids[-1] in tokenizer.eos_token_ids
    for position, entry in enumerate(completion.logprobs):
        finite = {t: lp.logprob for t, lp in entry.items() if math.isfinite(lp.logprob)}
        done = tokenizer.decode(completion.token_ids[:position])
        for token in finite:  # only tokens the grammar allows have mass: a choice's next piece, or EOS at its end
            if position == len(completion.logprobs) - 1:
                assert token in tokenizer.eos_token_ids
            else:
                piece = done + tokenizer.decode([token])
                assert any(choice.startswith(piece) for choice in ("yes", "no")), piece
        if len(finite) < len(entry):  # every allowed token is listed: their probabilities sum to one
            assert sum(math.exp(v) for v in finite.values()) == pytest.approx(1.0, abs=1e-4)


def test_stop_strings_and_max_tokens_still_end_constrained_requests(llm):
    prompt = random_prompts([9], VOCAB, seed=7)
    stopped = run(llm, prompt, SamplingParams(temperature=0, stop=[","], **constrained(json=SCHEMAS[0])))[0].outputs[0]
    assert stopped.finish_reason == "stop" and "," not in stopped.text and stopped.text.startswith("{")
    cut = run(llm, prompt, SamplingParams(temperature=0, **constrained(max_tokens=3, json=SCHEMAS[1])))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and cut.text.startswith("{")


def test_constrained_requests_survive_preemption(ckpt):
    with make_llm(str(ckpt), block_size=4, num_kv_blocks=24) as small:
        prompts = random_prompts([12, 13, 14, 15], VOCAB, seed=8)
        params = [SamplingParams(temperature=1.0, seed=i, **constrained(json=SCHEMAS[0])) for i in range(4)]
        outs = run(small, prompts, params)
        assert small.engine.scheduler.num_preemptions > 0
        for o in outs:
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS[0])
        assert_all_blocks_free(small)


def test_a_prefilled_request_continues_under_the_grammar_on_a_decode_engine(ckpt):
    params = SamplingParams(temperature=0.9, seed=5, **constrained(json=SCHEMAS[1]))
    prompt = random_prompts([13], VOCAB, seed=9)[0]
    with make_llm(str(ckpt)) as prefill, make_llm(str(ckpt)) as decode, make_llm(str(ckpt)) as colocated:
        whole = run(colocated, [prompt], params)[0].outputs[0]
        prefill.engine.add_request("r", prompt, params, prefill_only=True)
        firsts = [d for _ in range(50) if prefill.engine.has_unfinished_requests() for d in prefill.engine.step()]
        [first] = firsts
        src = list(first.kv_block_ids)
        dst = decode.engine.reserve_blocks(len(src))
        decode.engine.kv_cache.kv[:, :, torch.tensor(dst)] = prefill.engine.kv_cache.kv[:, :, torch.tensor(src)]
        assert prefill.engine.release_prefilled("r")
        deltas = [decode.engine.add_prefilled_request("r", prompt, first.new_token_ids[0], params, dst)]
        deltas += [d for _ in range(200) if decode.engine.has_unfinished_requests() for d in decode.engine.step()]
        assert [t for d in deltas for t in d.new_token_ids] == whole.token_ids
        jsonschema.validate(json.loads("".join(d.new_text for d in deltas)), SCHEMAS[1])
        for engine in (prefill, decode, colocated):
            assert_all_blocks_free(engine)


def test_a_resumed_request_continues_its_grammar_and_refuses_tokens_off_it(llm):
    prompt = random_prompts([10], VOCAB, seed=10)[0]
    params = SamplingParams(temperature=0, **constrained(regex=r"[0-9]{6}"))
    whole = run(llm, [prompt], params)[0].outputs[0]
    head = whole.token_ids[:2]
    llm.engine.add_request("resumed", prompt + head, params, num_resumed_tokens=2)
    tail = [d for _ in range(50) if llm.engine.has_unfinished_requests() for d in llm.engine.step()]
    assert head + [t for d in tail for t in d.new_token_ids] == whole.token_ids
    off = llm.get_tokenizer().encode("ab", add_special_tokens=False)
    with pytest.raises(ValueError, match="does not follow"):
        llm.engine.add_request("off", prompt + off, params, num_resumed_tokens=len(off))
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "json schema"),
    (dict(json={"type": "object", "dependentSchemas": {"a": {}}}), "dependentSchemas"),
    (dict(regex="a(b"), "regex"),
    (dict(grammar="start: undefined_rule"), "grammar"),
])
def test_specs_that_do_not_compile_are_value_errors_before_anything_runs(llm, spec, message):
    good = SamplingParams(max_tokens=4, temperature=0)
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=message):
        run(llm, random_prompts([5, 5], VOCAB, seed=11), [good, bad])
    assert_all_blocks_free(llm)
    assert run(llm, random_prompts([5], VOCAB, seed=11), good)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("fields, message", [
    (dict(), "exactly one"), (dict(regex="a", choice=["a"]), "exactly one"), (dict(choice=[]), "empty"),
    (dict(json="{not json"), "not valid JSON"), (dict(choice=["a", 3]), "non-empty strings"), (dict(regex=""), "regex"),
])
def test_malformed_specs_are_refused_on_construction(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_equal_specs_compile_once_and_the_embedded_model_is_constrained_too():
    with make_llm("tiny") as tiny:
        schema_text = json.dumps(SCHEMAS[0])
        params = [SamplingParams(temperature=1.0, seed=i, **constrained(json=spec))
                  for i, spec in enumerate([SCHEMAS[0], schema_text, json.loads(schema_text)])]
        outs = run(tiny, random_prompts([4, 5, 6], 256, seed=12), params)
        for o in outs:
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS[0])
        assert tiny.engine.structured._compiler.num_cached == 1
        assert_all_blocks_free(tiny)


def test_a_compiling_request_waits_outside_the_schedule_while_others_run(llm):
    engine = llm.engine
    gate = threading.Event()
    engine.structured._compiler_now()._pool.submit(gate.wait)  # the compile thread is busy until the gate opens
    schema = {"type": "object", "properties": {"slow": {"enum": ["a", "b"]}}, "required": ["slow"]}
    prompt = random_prompts([6], VOCAB, seed=13)[0]
    engine.add_request("structured", prompt, SamplingParams(temperature=0, **constrained(json=schema)))
    engine.add_request("plain", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    early = [d for _ in range(6) for d in engine.step()]
    assert {d.request_id for d in early} == {"plain"} and early[-1].finish_reason == "length"
    assert engine.has_unfinished_requests() and engine.get_sequence("structured").grammar is None
    gate.set()
    late = [d for _ in range(200) if engine.has_unfinished_requests() for d in engine.step()]
    assert json.loads("".join(d.new_text for d in late)) in ({"slow": "a"}, {"slow": "b"})
    assert_all_blocks_free(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_mask_is_applied_on_the_device_without_a_sync_of_its_own():
    """Issue 30 on a GPU: the bitmask crosses in the step's one upload and is applied on the device; a batch with
    constrained rows syncs exactly as often as the same batch without (once: the picks' copy to the host)."""
    class Filler:
        words = 2

        def fill_into(self, grammars, out):
            out[:] = 0
            out[:, 0] = 0b1010  # tokens 1 and 3

    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(3)).cuda()  # [4, 40]
    params, sampler = [SamplingParams(temperature=0)] * 4, Sampler(mask_filler=Filler())

    def syncs_of(constraints) -> tuple[int, list[int]]:
        sampler.sample(logits, params, [5] * 4, constraints=constraints)  # warm: kernels, staging buffers
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                tokens = sampler.sample(logits, params, [5] * 4, constraints=constraints).tokens
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return len(real_syncs(caught)), tokens

    plain, plain_tokens = syncs_of(None)
    masked, masked_tokens = syncs_of([object(), None, object(), None])
    assert masked == plain == 1
    assert masked_tokens[0] in (1, 3) and masked_tokens[2] in (1, 3) and masked_tokens[1::2] == plain_tokens[1::2]


def test_the_sampler_masks_only_constrained_rows_and_does_no_work_without_them():
    class Filler:
        calls, words = 0, 2

        def fill_into(self, grammars, out):
            Filler.calls += 1
            out[:] = 0
            out[:, 0] = 0b1010  # tokens 1 and 3

    logits = torch.randn(3, 40)
    assert apply_token_masks(logits, [None, None, None], Filler()) is logits and Filler.calls == 0
    masked = apply_token_masks(logits, [None, object(), None], Filler())
    assert torch.equal(masked[[0, 2]], logits[[0, 2]]) and Filler.calls == 1
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [1, 3]
    picks = Sampler(mask_filler=Filler()).sample(logits, [SamplingParams(temperature=0)] * 3, [5] * 3,
                                                 constraints=[object()] * 3).tokens
    assert all(t in (1, 3) for t in picks)
