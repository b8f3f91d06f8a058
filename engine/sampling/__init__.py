"""Turning a step's logits into tokens: the `Sampler` (greedy, temperature, top-k, top-p, min-p, seeded rows;
vectorised over rows on the logits' device), the logits processors applied before the pick (penalties,
logit_bias, min_tokens), the nucleus search (`nucleus.py`), and the logprobs of the sampled and prompt
tokens (`logprobs.py`, `prompt_logprobs.py`). Pure functions of tensors and `SamplingParams`: no KV, no model.
"""
