"""Builders of tiny, real Hugging Face checkpoints for the engine's correctness tests.

Every checkpoint is a directory that transformers itself loads (`AutoModelForCausalLM.from_pretrained`,
`AutoTokenizer.from_pretrained`), so transformers can serve as the oracle for logits, greedy tokens,
tokenization and chat templates. Nothing is downloaded: weights are seeded random, the tokenizer is a
byte-level BPE trained here on a small embedded English corpus.

Shapes: hidden 64, 2 layers, intermediate 128, 4 query heads, float32, vocab 384 (the tokenizer has 360
tokens, so ids 360..383 exist only in the model, as in real padded vocabularies). llama/llama3/mistral: 2 KV
heads, head_dim 16; llama3 adds Llama-3 rope scaling (changes 5 of the 8 rotary frequencies); qwen2: qkv bias,
tied embeddings (no lm_head.weight in the file), rope_theta 1e6; qwen3: q/k RMSNorm, head_dim 32 != 64/4, 1 KV
head; mistral keeps transformers' sliding_window=4096, larger than max_position_embeddings=1024.

Weight init: `initializer_range` is 0.2 (transformers' default 0.02 gives near-flat logits, |logit| < 1.3,
median top-1 minus top-2 margin ~0.04, and tied-embedding qwen2 then repeats one token forever). Measured at
0.2 over seeds 0-2 x 4 random prompts x 32 greedy steps per arch: median margin 0.36-0.45, 10th percentile
0.05-0.075, 1st percentile 0.003-0.019, margins under 1e-3 on at most 0.5% of steps; 24-28 distinct tokens per
32 on average. Attention scores have std ~2.5, neither uniform nor one-hot, so RoPE and masking matter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

ARCHITECTURES = ("llama", "llama3", "qwen2", "qwen3", "mistral")

# Llama-style tokenizers use <s>/</s> (ids 0, 1) and add BOS; Qwen-style ones add no BOS and use ChatML specials.
LLAMA_SPECIAL_TOKENS = ("<s>", "</s>", "<|eot|>")
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKENIZER_VOCAB_TARGET = 360
MODEL_VOCAB_MULTIPLE = 64  # the model's embedding is padded past the tokenizer vocab, as in real models
DEFAULT_INITIALIZER_RANGE = 0.2

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Prefill reads the whole prompt at once, and decode writes one token at a time for every running request.
The scheduler packs many prompts into one batch so that the accelerator stays busy while the queue is long.
Each block of the key value cache holds sixteen tokens; blocks are freed when a request finishes or is cancelled.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.
She sells sea shells by the sea shore, and the shells she sells are surely sea shells.
Numbers like 1, 2, 3, 42 and 2024 appear in text, as do questions: what time is it? Where are we going?
Hello world! Hello there, friend. How are you today? I am fine, thank you, and you?
The model reads tokens, computes attention over the past, and predicts the next token with a softmax.
Rain in the morning, sun in the afternoon, and a cool wind from the west in the evening.
"""

LLAMA_CHAT_TEMPLATE = """{{ bos_token }}{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
<|{{ message['role'] }}|>
{{ message['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
    {% set header = '<|assistant|>' %}
{{ header }}
{% endif %}"""

CHATML_TEMPLATE = """{% for message in messages %}
{% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

TOOL_USE_TEMPLATE = "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"


def is_qwen_style(arch: str) -> bool:
    """Qwen checkpoints get a Qwen-style tokenizer: transformers 5 rebuilds qwen2 tokenizers with Qwen's own
    NFC normalizer and split regex whatever tokenizer.json says, so the file must already be Qwen-shaped."""
    return arch.startswith("qwen")


def build_tokenizer(*, qwen_style: bool) -> Tokenizer:
    """Train a byte-level BPE on `CORPUS` (deterministic). Llama style: GPT-2 split, post-processor prepends
    `<s>`. Qwen style: NFC + Qwen's split regex, ChatML special tokens, no BOS."""
    special_tokens = QWEN_SPECIAL_TOKENS if qwen_style else LLAMA_SPECIAL_TOKENS
    tokenizer = Tokenizer(models.BPE())
    if qwen_style:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_TARGET, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if qwen_style:
        tokenizer.post_processor = byte_level
    else:
        bos = special_tokens[0]
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
        tokenizer.post_processor = processors.Sequence([byte_level, template])
    return tokenizer


def _added_token_dict(content: str) -> dict:
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True}


def _tokenizer_config(arch: str) -> dict:
    """Llama style: BOS added, a Llama-like template string. Qwen style: no BOS, ChatML, named templates."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # a model-specific class could rebuild the pipeline in v5
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
    }
    if is_qwen_style(arch):
        config.update(bos_token=None, eos_token=_added_token_dict("<|im_end|>"), pad_token="<|endoftext|>",
                      unk_token=None, add_bos_token=False)
        config["chat_template"] = [{"name": "default", "template": CHATML_TEMPLATE},
                                   {"name": "tool_use", "template": TOOL_USE_TEMPLATE}]
    else:
        config.update(bos_token="<s>", eos_token=_added_token_dict("</s>"), add_bos_token=True,
                      chat_template=LLAMA_CHAT_TEMPLATE)
    return config


def write_tokenizer_files(out_dir: Path, arch: str) -> Tokenizer:
    """Write tokenizer.json and tokenizer_config.json for `arch` into `out_dir`; return the tokenizer."""
    tokenizer = build_tokenizer(qwen_style=is_qwen_style(arch))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config_text = json.dumps(_tokenizer_config(arch), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    return tokenizer


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def model_config(arch: str, vocab_size: int, **overrides):
    """The transformers config object of a tiny `arch` model; `overrides` replace any field."""
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHITECTURES}")
    fields = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        initializer_range=DEFAULT_INITIALIZER_RANGE, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model_type = {"llama3": "llama"}.get(arch, arch)
    if arch == "llama3":
        fields["rope_parameters"] = {
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
        }
    elif arch == "qwen2":
        fields.update(tie_word_embeddings=True, eos_token_id=2, rope_parameters={
            "rope_type": "default", "rope_theta": 1000000.0})
    elif arch == "qwen3":
        fields.update(head_dim=32, num_key_value_heads=1, eos_token_id=[2])
    fields.update(overrides)
    config = AutoConfig.for_model(model_type, **fields)
    config.dtype = torch.float32
    return config


def _generation_config(arch: str) -> dict:
    """EOS spellings vary on purpose: a list (llama*, qwen*), an int (mistral). Unioned with config.json's and
    the tokenizer's eos_token, the EOS ids are {1, 2} (</s>, <|eot|>) for llama*, {1} for mistral and
    {0, 2} (<|endoftext|>, <|im_end|>) for qwen*."""
    eos = {"mistral": 1, "qwen2": [2, 0], "qwen3": [2, 0]}.get(arch, [1, 2])
    return {"bos_token_id": 0, "eos_token_id": eos, "do_sample": False}


def _max_shard_size_for(state_dict: dict, shards: int) -> int:
    """The smallest `max_shard_size` (bytes) for which transformers' packing makes at most `shards` files."""
    from huggingface_hub import split_torch_state_dict_into_shards

    def shard_count(max_bytes: int) -> int:
        return len(split_torch_state_dict_into_shards(state_dict, max_shard_size=max_bytes).filename_to_tensors)

    low, high = 1, sum(tensor.numel() * tensor.element_size() for tensor in state_dict.values())
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if shard_count(middle) <= shards else (middle + 1, high)
    if shard_count(low) != shards:
        raise ValueError(f"cannot split this model's {len(state_dict)} tensors into exactly {shards} shards")
    return low


def make_checkpoint(out_dir: Path, arch: str, *, seed: int = 0, shards: int = 1, **config_overrides) -> Path:
    """Write a complete tiny HF checkpoint of `arch` into `out_dir` (created if missing) and return it.

    Files: config.json, generation_config.json, model.safetensors (or `shards` shards plus
    model.safetensors.index.json), tokenizer.json, tokenizer_config.json. Weights depend only on
    (arch, seed, config_overrides). float32. `config_overrides` go into the transformers config.
    """
    from transformers import AutoModelForCausalLM

    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer_files(out_dir, arch)
    vocab_size = _round_up(tokenizer.get_vocab_size(), MODEL_VOCAB_MULTIPLE)
    config = model_config(arch, vocab_size, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    save_kwargs = {"safe_serialization": True}
    if shards > 1:
        save_kwargs["max_shard_size"] = _max_shard_size_for(model.state_dict(), shards)
    model.save_pretrained(out_dir, **save_kwargs)
    written = len(list(out_dir.glob("model*.safetensors")))
    if written != shards:
        raise RuntimeError(f"asked for {shards} weight shards, transformers wrote {written}")
    (out_dir / "generation_config.json").write_text(json.dumps(_generation_config(arch), indent=2))
    return out_dir


def hf_greedy_generate(model, prompts_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations by transformers' `generate(do_sample=False)`, one prompt at a time (no padding).

    EOS never stops generation: the model's generation_config is replaced by a bare
    `GenerationConfig(do_sample=False)`, because passing `eos_token_id=None` to `generate` is silently
    refilled from the model's own generation_config in transformers 5.x. Every result therefore has exactly
    `max_new_tokens` tokens (compare with the engine's `SamplingParams(temperature=0, ignore_eos=True)`).
    Returns only the new tokens. Does not change `model`'s weights; it does replace its generation_config.
    """
    from transformers import GenerationConfig

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    model.generation_config = GenerationConfig(do_sample=False)
    continuations = []
    for prompt in prompts_token_ids:
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        input_ids = torch.tensor([list(prompt)], dtype=torch.long)
        with torch.no_grad():
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=max_new_tokens, do_sample=False)
        continuations.append(output[0, input_ids.shape[1]:].tolist())
    return continuations


def load_hf_model(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' CPU model of a checkpoint directory (float32 unless told), in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(Path(path), dtype=dtype).eval()
