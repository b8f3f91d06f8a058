"""What a large input may cost before admission: the characters-per-token bound that refuses a prompt too long by
its length alone holds for the tokenizers it is granted to and is refused to pipelines that can drop or fuse
characters; large texts encode and decode exactly as the tokenizer does, without the GIL; and the InputPool
prepares large inputs on its bounded threads, refusing at once past its waiting bound."""
from __future__ import annotations

import asyncio
import random
import threading

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from cluster.api.input_pool import InputLimits, InputPool
from cluster.api.prompt_encoder import PromptEncoder
from cluster.api.request_validation import InvalidField
from cluster.api.token_bounds import chars_per_token_bound
from cluster.backend import BackendOverloaded
from engine.text.tokenizer import ByteTokenizer, HFTokenizer

SAMPLES = ["Hello, world! " * 50, "ab " * 3000, " " * 5000, "\n\n\t  " * 700, "日本語のテキスト" * 300,
           "e\u0301a\u0300" * 800, "🙂🚀" * 900, "<s></s><unk>" * 400, "0123456789" * 600,
           "".join(map(chr, range(32, 2000)))]


@pytest.fixture(scope="module")
def llama_tokenizer(tiny_checkpoint) -> HFTokenizer:
    return HFTokenizer.from_dir(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def qwen_tokenizer(tiny_checkpoint) -> HFTokenizer:
    return HFTokenizer.from_dir(tiny_checkpoint("qwen2"))


def hf(native: Tokenizer) -> HFTokenizer:
    return HFTokenizer(native, special_tokens={}, eos_token_ids=(), chat_template=None)


def copy_of(tokenizer: HFTokenizer) -> Tokenizer:
    return Tokenizer.from_str(tokenizer._backend.to_str())


def random_texts(tokenizer: HFTokenizer, count: int = 30) -> list[str]:
    """Texts of the tokenizer's own longest vocabulary entries and random characters: the bound's worst cases."""
    rng, vocab = random.Random(0), sorted(tokenizer._backend.get_vocab(), key=len, reverse=True)
    decoded = [tokenizer.decode([tokenizer._backend.token_to_id(token)]) for token in vocab[:40]]
    return ["".join(rng.choice(decoded) if rng.random() < 0.8 else chr(rng.randrange(32, 0x3000))
                    for _ in range(rng.randrange(1, 400))) for _ in range(count)]


def test_the_bound_holds_for_byte_level_bpe_and_bytes(llama_tokenizer):
    bound = chars_per_token_bound(llama_tokenizer)
    assert bound is not None and bound >= 3
    for text in SAMPLES + random_texts(llama_tokenizer):
        assert len(llama_tokenizer.encode(text, add_special_tokens=False)) * bound >= len(text), text[:40]
    assert chars_per_token_bound(ByteTokenizer()) == 1
    assert all(len(ByteTokenizer().encode(text, add_special_tokens=False)) >= len(text) for text in SAMPLES)


def test_pipelines_that_can_drop_or_fuse_characters_get_no_bound(llama_tokenizer, qwen_tokenizer):
    assert chars_per_token_bound(qwen_tokenizer) is None  # NFC composes characters
    assert chars_per_token_bound(object()) is None
    spaces = copy_of(llama_tokenizer)
    spaces.pre_tokenizer = pre_tokenizers.Whitespace()
    assert spaces.encode(" " * 10_000, add_special_tokens=False).ids == []  # why: 10,000 characters, no token
    truncating, stripping, swallowing = copy_of(llama_tokenizer), copy_of(llama_tokenizer), copy_of(llama_tokenizer)
    truncating.enable_truncation(16)
    stripping.normalizer = normalizers.Strip()
    swallowing.add_tokens([AddedToken("<mask>", lstrip=True)])
    fused = Tokenizer(models.BPE({"[UNK]": 0, "a": 1}, [], unk_token="[UNK]", fuse_unk=True))
    word_piece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    for native in (spaces, truncating, stripping, swallowing, fused, word_piece):
        assert chars_per_token_bound(hf(native)) is None, native.to_str()[:200]
    unfused = Tokenizer(models.BPE({"[UNK]": 0, "a": 1}, [], unk_token="[UNK]", fuse_unk=False))
    assert chars_per_token_bound(hf(unfused)) == 5  # each unknown character its own "[UNK]"


def test_large_texts_encode_and_decode_as_the_tokenizer_does(llama_tokenizer, qwen_tokenizer):
    for tokenizer in (llama_tokenizer, qwen_tokenizer):
        encoder = PromptEncoder(tokenizer, max_model_len=10 ** 7, large_chars=100)
        for text in SAMPLES:
            assert encoder.encode_prompt(text) == tuple(tokenizer.encode(text))
            assert encoder.tokenize(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
            ids = tokenizer.encode(text)
            assert encoder.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)
        with pytest.raises(InvalidField, match="prompt"):
            encoder.encode_prompt("x" * 500 + "\ud800")
        with pytest.raises(InvalidField, match="must be a string"):
            encoder.encode_prompt(["not", "text"])


def test_a_prompt_past_the_context_is_refused_by_its_length_or_its_count(qwen_tokenizer):
    class CountingBytes(ByteTokenizer):
        encoded = 0

        def encode(self, text, add_special_tokens=True):
            CountingBytes.encoded += 1
            return super().encode(text, add_special_tokens)

    encoder = PromptEncoder(CountingBytes(), max_model_len=100)
    with pytest.raises(ValueError, match="at least 101 tokens.*more than the model's context of 100 tokens"):
        encoder.encode_prompt("x" * 101)
    assert CountingBytes.encoded == 0  # refused by its characters alone
    assert len(encoder.encode_prompt("x" * 99)) == 100  # with BOS
    with pytest.raises(ValueError, match="has 101 tokens"):
        encoder.encode_prompt("x" * 100)  # within the characters' bound, past the context once tokenized
    text = "many words " * 2000  # qwen has no bound: counted off its encoding, without the list of ids
    with pytest.raises(ValueError, match=f"has {len(qwen_tokenizer.encode(text))} tokens"):
        PromptEncoder(qwen_tokenizer, max_model_len=1024).encode_prompt(text)


def test_the_pool_prepares_large_inputs_on_its_threads_and_bounds_those_waiting():
    async def scenario():
        pool, release = InputPool(InputLimits(off_loop_bytes=10, workers=1, max_waiting=1)), threading.Event()
        try:
            assert await pool.prepare(10, threading.current_thread) is threading.current_thread()
            assert (await pool.prepare(11, threading.current_thread)).name.startswith("tandem-input")
            running = asyncio.ensure_future(pool.prepare(11, release.wait))
            ran = []
            waiting = asyncio.ensure_future(pool.prepare(11, lambda: ran.append(True)))
            await asyncio.sleep(0.05)
            assert pool.pending == 2
            with pytest.raises(BackendOverloaded):
                await pool.prepare(11, lambda: ran.append(True))
            assert await pool.prepare(5, lambda: "small inputs pass") == "small inputs pass"
            waiting.cancel()  # its client left: it never runs
            await asyncio.sleep(0)  # the cancel reaches the pool's queue on the loop's next turn
            release.set()
            assert await running is True
            await asyncio.sleep(0.05)
            assert pool.pending == 0 and ran == [] and waiting.cancelled()
        finally:
            release.set()
            pool.close()
        with pytest.raises(RuntimeError):
            await pool.prepare(11, lambda: None)

    asyncio.run(scenario())


@pytest.mark.parametrize("fields", [{"workers": 0}, {"max_waiting": -1}, {"off_loop_bytes": 1.5},
                                    {"workers": True}])
def test_input_limits_are_checked(fields):
    with pytest.raises(ValueError):
        InputLimits(**fields)
