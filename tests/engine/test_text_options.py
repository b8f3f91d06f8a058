"""vLLM's text options in the engine: include_stop_str_in_output (a stop string, or the stop token that ends
a request, kept in the text), skip_special_tokens and spaces_between_special_tokens, streamed and whole, with
transformers' tokenizer decoding the same tokens as the oracle."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from engine import SamplingParams
from engine.text.tokenizer import HFTokenizer
from tests.support.engine_checks import assert_all_blocks_free
from tests.support.engines import make_llm

GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("qwen2")  # ChatML special tokens; EOS <|im_end|>


@pytest.fixture(scope="module")
def llm(ckpt):
    with make_llm(str(ckpt)) as llm:
        yield llm


@pytest.fixture(scope="module")
def theirs(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


def streamed(llm, prompt, params: SamplingParams) -> tuple[list[int], str, str]:
    """(tokens, concatenated text deltas, finish reason) of one request stepped alone."""
    llm.engine.add_request("s", prompt, params)
    tokens, text, reason = [], "", None
    while llm.engine.has_unfinished_requests():
        for delta in llm.engine.step():
            tokens += delta.new_token_ids
            text += delta.new_text
            reason = delta.finish_reason or reason
    return tokens, text, reason


def test_a_stop_string_is_kept_with_include_stop_str_in_output(llm, theirs):
    prompt = theirs("The cache holds keys and values")["input_ids"]
    tokens, text, _ = streamed(llm, prompt, SamplingParams(**GREEDY))
    full = theirs.decode(tokens)
    stop = full[4:7]
    assert stop.strip(), f"need visible text to stop on, got {full!r}"
    for include in (False, True):
        got_tokens, got_text, reason = streamed(llm, prompt, SamplingParams(**GREEDY, stop=[stop],
                                                                          include_stop_str_in_output=include))
        end = full.index(stop) + (len(stop) if include else 0)
        assert (got_text, reason) == (full[:end], "stop")
        assert theirs.decode(got_tokens).startswith(got_text)
    assert_all_blocks_free(llm)


def test_the_stop_token_that_ends_a_request_is_in_the_text_only_when_asked(llm, theirs):
    """EOS forced by logit_bias, special tokens kept: vLLM leaves the ending stop token out of the text unless
    include_stop_str_in_output; a stop_token_ids entry that is an ordinary token likewise."""
    prompt = theirs("Hello world")["input_ids"]
    eos = theirs.convert_tokens_to_ids("<|im_end|>")
    ordinary = streamed(llm, prompt, SamplingParams(**GREEDY))[0]
    cases = [dict(logit_bias={eos: 100.0}, min_tokens=3, skip_special_tokens=False),
             dict(stop_token_ids=[ordinary[5]], skip_special_tokens=False)]
    for case in cases:
        params = {**GREEDY, "ignore_eos": False, **case}
        for include in (False, True):
            tokens, text, reason = streamed(llm, prompt, SamplingParams(**params, include_stop_str_in_output=include))
            assert reason == "stop"
            assert text == theirs.decode(tokens if include else tokens[:-1], skip_special_tokens=False)
    assert_all_blocks_free(llm)


def test_special_tokens_are_skipped_unless_asked(llm, theirs):
    """ignore_eos with EOS pushed up: the output is special tokens between ordinary ones."""
    prompt = theirs("Hello world")["input_ids"]
    eos = theirs.convert_tokens_to_ids("<|im_end|>")
    for skip in (True, False):
        for spaces in (True, False):
            params = SamplingParams(**GREEDY, logit_bias={eos: 4.0}, skip_special_tokens=skip,
                                    spaces_between_special_tokens=spaces)
            tokens, text, _ = streamed(llm, prompt, params)
            assert eos in tokens and len(set(tokens)) > 1
            assert text == theirs.decode(tokens, skip_special_tokens=skip)  # byte-level BPE: no spaces either way
    assert_all_blocks_free(llm)


def test_spaces_between_special_tokens_with_a_decoder_that_puts_spaces(tmp_path):
    """A WordPiece tokenizer's decoder joins tokens with spaces; spaces_between_special_tokens=False joins the
    special tokens to the text around them without one (each run of other tokens decoded as the library does)."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    backend = BackendTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(["[CLS]", "[SEP]"])
    backend.save(str(tmp_path / "tokenizer.json"))
    ours = HFTokenizer.from_dir(tmp_path)
    ids = [1, 3, 4, 5, 2, 2]
    assert ours.decode(ids, skip_special_tokens=False) == backend.decode(ids, skip_special_tokens=False)
    joined = ours.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert joined == "[CLS]" + backend.decode([3, 4, 5]) + "[SEP][SEP]" == "[CLS]hello worlds[SEP][SEP]"
    assert ours.decode(ids, spaces_between_special_tokens=False) == backend.decode(ids) == "hello worlds"
