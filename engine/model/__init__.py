"""The model: `CausalLM` (Llama / Mistral / Qwen2 / Qwen3 over one packed batch, `causal_lm.py`), its building
blocks (`layers.py`: RMSNorm, rotary embeddings, the gated MLP; `linear.py`: the few-row CPU fast path),
loading a Hugging Face checkpoint onto a device (`loader.py`) and the embedded default model
(`default_model.py`). Reads and writes the KV pool only through attention/.
"""
