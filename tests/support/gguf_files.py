"""GGUF files written here with the `gguf` package's writer, as llama.cpp's converter writes them, from the tiny
Hugging Face checkpoints of tests/support/factories.py: the same weights (quantized to the type asked for; 1-D
tensors stay F32, as llama.cpp keeps them), attn_q / attn_k rows permuted for llama, the tokenizer's vocabulary,
merges, token types, special ids and chat template in the metadata. transformers reads them back as the oracle
(`from_pretrained(directory, gguf_file=name)`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3"}
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
CONTROL, NORMAL, UNUSED = 3, 1, 5


def write_gguf(checkpoint: Path, out: Path, quant: str = "F32") -> Path:
    """`checkpoint` (a tiny HF directory) as the GGUF file `out`, its 2-D weights in `quant` (F32, F16, BF16,
    Q8_0, Q4_0, Q4_1, ...)."""
    import gguf
    config = json.loads((checkpoint / "config.json").read_text())
    arch = GGUF_ARCH[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(out), arch)
    _write_shape(writer, config)
    _write_tokenizer(writer, checkpoint, config, arch)
    for name, array in load_file(str(checkpoint / "model.safetensors")).items():
        gguf_name = _gguf_name(name)
        if arch == "llama" and ".attn_q." in gguf_name:
            array = _permute(array, config["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in gguf_name:
            array = _permute(array, config["num_key_value_heads"])
        _add_tensor(writer, gguf_name, array.astype(np.float32), quant if array.ndim > 1 else "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_shape(writer, config: dict) -> None:
    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_value_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config.get("rope_parameters", {})["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])


def _write_tokenizer(writer, checkpoint: Path, config: dict, arch: str) -> None:
    """The tokenizer as llama.cpp's converter writes a byte-level BPE: every id up to the model's vocabulary
    (ids past the tokenizer's are [PADn], unused), control tokens marked, the merges as "a b"."""
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    by_id = {index: token for token, index in tokenizer["model"]["vocab"].items()}
    added = {entry["id"]: entry["content"] for entry in tokenizer["added_tokens"]}
    by_id.update(added)
    tokens = [by_id.get(index, f"[PAD{index}]") for index in range(config["vocab_size"])]
    types = [CONTROL if index in added else NORMAL if index in by_id else UNUSED for index in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {token: index for index, token in enumerate(tokens)}
    bos = tokenizer_config.get("bos_token")
    if bos is not None:
        writer.add_bos_token_id(ids[bos])
    eos = tokenizer_config["eos_token"]
    writer.add_eos_token_id(ids[eos["content"] if isinstance(eos, dict) else eos])
    writer.add_add_bos_token(bool(tokenizer_config.get("add_bos_token")))
    template = tokenizer_config["chat_template"]
    writer.add_chat_template(template if isinstance(template, str) else template[0]["template"])


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)          # model.layers.N.<module>.<weight|bias>
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{LAYER_NAMES[module]}.{suffix}"


def _permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter (LlamaModel.permute): each head's rotary halves interleaved."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _add_tensor(writer, name: str, array: np.ndarray, quant: str) -> None:
    import gguf
    qtype = gguf.GGMLQuantizationType[quant]
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, array)
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def write_sentencepiece_vocab_gguf(out: Path) -> Path:
    """A GGUF whose tokenizer is a sentencepiece BPE (llama.cpp's "llama" kind, as Llama 2 and Mistral v0.1 files
    carry): <unk>, <s>, </s>, the 256 <0xNN> byte tokens, then pieces learned on the factories' corpus, each with
    a score (earlier merges score higher) and no merges in the file, as llama.cpp writes them. The model part is
    a shape and an embedding only: for tokenizer tests."""
    import gguf
    from tokenizers import SentencePieceBPETokenizer

    from tests.support.factories import CORPUS
    learner = SentencePieceBPETokenizer(add_prefix_space=True)
    learner.train_from_iterator(CORPUS.splitlines(), vocab_size=400, min_frequency=1, show_progress=False)
    learned = sorted(learner.get_vocab().items(), key=lambda item: item[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [piece for piece, _ in learned if piece not in tokens]
    scores = [0.0] * 259 + [-float(rank) for rank in range(len(tokens) - 259)]
    types = [2, 3, 3] + [6] * 256 + [NORMAL] * (len(tokens) - 259)  # unknown, control, byte, normal
    writer = gguf.GGUFWriter(str(out), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 32),
                       (writer.add_feed_forward_length, 64), (writer.add_head_count, 2)):
        add(value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
