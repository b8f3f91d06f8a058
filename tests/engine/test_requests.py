"""Request lifecycle: stop conditions, bad input, abort, and the prefill-only / decode-only split."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import make_llm

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=2024, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3"))


@pytest.fixture(scope="module")
def llm(ckpt):
    with make_llm(ckpt) as llm:
        yield llm


def test_stop_token_ids_and_max_tokens(llm):
    prompt = random_prompts([20], 300, seed=1)
    full = llm.generate(prompt_token_ids=prompt, sampling_params=GREEDY)[0].outputs[0]
    stop_at = full.token_ids[4]
    first = full.token_ids.index(stop_at)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    stopped = llm.generate(prompt_token_ids=prompt, sampling_params=params)[0].outputs[0]
    assert stopped.token_ids == full.token_ids[:first + 1]   # the stop token is kept
    assert stopped.finish_reason == "stop"
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    assert_all_blocks_free(llm)


def test_stop_string_cuts_text(llm):
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("The cache holds keys and values")
    full = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].outputs[0]
    stop = full.text[3:6]
    assert stop.strip(), f"need visible text to stop on, got {full.text!r}"
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    assert stop not in out.text
    assert_all_blocks_free(llm)


def test_eos_stops_unless_ignored(llm):
    eos_ids = llm.get_tokenizer().eos_token_ids
    prompts = random_prompts([6] * 40, 300, seed=2)
    stopping = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=40, temperature=0))
    hits = [(p, o.outputs[0]) for p, o in zip(prompts, stopping) if o.outputs[0].finish_reason == "stop"]
    assert hits, "some greedy continuation of a random prompt should reach EOS"
    prompt, out = hits[0]
    assert out.token_ids[-1] in eos_ids and len(out.token_ids) < 40
    ignoring = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = llm.generate(prompt_token_ids=[prompt], sampling_params=ignoring)[0].outputs[0]
    assert full.finish_reason == "length" and full.token_ids[:len(out.token_ids)] == out.token_ids
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(stop=[""]), "stop"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=2 ** 63), "top_k"),
    (dict(seed=-1), "seed"),
])
def test_bad_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_engine_stays_usable(llm):
    vocab = llm.engine.model_config.vocab_size
    too_long = [1] * (llm.engine.max_model_len + 1)
    for bad, message in [([[]], "empty"), ([too_long], "context"), ([[1, vocab]], "vocabulary"),
                         ([[1, -1]], "vocabulary"), ([[5, 6], []], "empty")]:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt_token_ids=bad, sampling_params=GREEDY)
        assert_all_blocks_free(llm)
    with pytest.raises(ValueError, match="exactly one"):
        llm.generate()
    with pytest.raises(ValueError, match="list of ints"):
        llm.engine.add_request("bad", None, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("dup", [1, 2], GREEDY)
        llm.engine.add_request("dup", [3], GREEDY)
    assert llm.engine.abort("dup")
    assert llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)[0].outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_bad_model_path_and_options():
    with pytest.raises(ValueError, match="does not exist"):
        make_llm("/nonexistent/model/dir")
    with pytest.raises(ValueError, match="unknown LLM option"):
        make_llm("tiny", block_sise=16)
    with pytest.raises(ValueError, match="dtype"):
        make_llm("tiny", dtype="float64")


def test_abort_frees_blocks_mid_generation(llm):
    engine = llm.engine
    for i, prompt in enumerate(random_prompts([30, 90, 150], 300, seed=3)):
        engine.add_request(f"a{i}", prompt, GREEDY)
    engine.step()
    engine.step()
    assert engine.num_free_blocks < engine.num_total_blocks
    assert all(engine.abort(f"a{i}") for i in range(3))
    assert not engine.abort("a0"), "a second abort is a no-op"
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefill_engine_hands_kv_to_decode_engine(ckpt, params):
    """Prefill-only on one engine, copy the KV blocks, decode-only on another: the same tokens as one
    engine doing both, greedy and seeded (a seeded draw depends on (seed, position) alone)."""
    prefill, decode, colocated = (make_llm(ckpt, block_size=8) for _ in range(3))
    prompts = random_prompts([1, 9, 8, 70], 300, seed=4)
    expected = [o.outputs[0].token_ids for o in colocated.generate(prompt_token_ids=prompts, sampling_params=params)]
    offset = decode.engine.reserve_blocks(3)  # offsets the decode side's block ids from the prefill side's
    for i, prompt in enumerate(prompts):
        prefill.engine.add_request(f"r{i}", prompt, params, prefill_only=True)
    firsts = {}
    while prefill.engine.has_unfinished_requests():
        firsts.update({d.request_id: d for d in prefill.engine.step()})
    tokens = {}
    for i, prompt in enumerate(prompts):
        src = list(firsts[f"r{i}"].kv_block_ids)
        dst = decode.engine.reserve_blocks(len(src))
        assert dst != src
        # [layers, 2, blocks, block_size, kv_heads, head_dim]: the transfer's payload
        decode.engine.kv_cache.kv[:, :, torch.tensor(dst)] = prefill.engine.kv_cache.kv[:, :, torch.tensor(src)]
        assert prefill.engine.release_prefilled(f"r{i}")
        first = firsts[f"r{i}"].new_token_ids[0]
        delta = decode.engine.add_prefilled_request(f"r{i}", prompt, first, params, dst)
        tokens[f"r{i}"] = list(delta.new_token_ids)
    while decode.engine.has_unfinished_requests():
        for d in decode.engine.step():
            tokens[d.request_id] += d.new_token_ids
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    spare = decode.engine.reserve_blocks(1)
    with pytest.raises(ValueError, match="first token"):
        decode.engine.add_prefilled_request("bad", [1, 2], 10 ** 6, GREEDY, spare)
    decode.engine.free_blocks(spare)  # a rejected admission leaves the blocks with the caller
    decode.engine.free_blocks(offset)
    for llm in (prefill, decode, colocated):
        assert_all_blocks_free(llm)


def test_a_tiny_temperature_is_greedy_and_harms_no_batch_mate(llm):
    """temperature 1e-40 would overflow the logits to inf (softmax NaN); below 1e-5 it means greedy, and
    the seeded request sampled in the same batch gets the tokens it gets alone."""
    prompts = random_prompts([10, 20, 30], 300, seed=12)
    tiny = SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts[:2], sampling_params=greedy)]
    expected.append(llm.generate(prompt_token_ids=prompts[2:], sampling_params=seeded)[0].outputs[0].token_ids)
    together = llm.generate(prompt_token_ids=prompts, sampling_params=[tiny, tiny, seeded])
    assert [o.outputs[0].token_ids for o in together] == expected
    assert_all_blocks_free(llm)


def stream(engine, request_id: str, prompt, params, *, num_resumed_tokens: int = 0, stop_after: int | None = None):
    """Steps `engine` with one request; returns (tokens, text) it streamed, ending early (abort) once
    stop_after tokens came."""
    engine.add_request(request_id, prompt, params, num_resumed_tokens=num_resumed_tokens)
    tokens, text = [], ""
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
            text += delta.new_text
        if stop_after is not None and len(tokens) >= stop_after:
            engine.abort(request_id)
            break
    return tokens, text


@pytest.mark.parametrize("kind", ["greedy", "greedy-stop-string", "seeded"])
def test_a_resumed_request_continues_token_for_token(llm, kind):
    """A request cut off after k tokens and resumed on an engine as prompt + those k tokens
    (num_resumed_tokens=k) streams exactly the rest of the uninterrupted run: tokens, text, finish."""
    prompt = random_prompts([25], 300, seed=13)[0]
    params = {"greedy": GREEDY, "greedy-stop-string": GREEDY, "seeded": SEEDED}[kind]
    if kind == "greedy-stop-string":  # a stop string late in the text, so text is held back on the way
        whole_text = stream(llm.engine, "probe", prompt, GREEDY)[1]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[whole_text[-4:-1]])
    whole = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].outputs[0]
    for k in (1, 4):
        head_tokens, head_text = stream(llm.engine, f"head{k}", prompt, params, stop_after=k)
        tail_tokens, tail_text = stream(llm.engine, f"tail{k}", prompt + head_tokens[:k], params,
                                        num_resumed_tokens=k)
        assert head_tokens[:k] + tail_tokens == whole.token_ids
        assert head_text + tail_text == whole.text
    with pytest.raises(ValueError, match="num_resumed_tokens"):
        llm.engine.add_request("bad", prompt, params, num_resumed_tokens=len(prompt))
    assert_all_blocks_free(llm)


def test_chat_uses_the_template_without_a_double_bos(tiny_checkpoint):
    llm = make_llm(str(tiny_checkpoint("llama")))
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    [out] = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt == rendered and "What is a KV cache?" in rendered
    assert out.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids.count(tokenizer.bos_token_id) == 1
    assert len(out.outputs[0].token_ids) == 4
    assert_all_blocks_free(llm)


def test_generation_stops_at_the_context_limit(ckpt):
    llm = make_llm(ckpt, max_model_len=32)
    prompt = random_prompts([30], 300, seed=11)[0]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="context"):
        llm.generate(prompt_token_ids=[prompt + [1, 2, 3]], sampling_params=GREEDY)
    assert_all_blocks_free(llm)
