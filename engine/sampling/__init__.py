"""Turning a step's logits into tokens: the `Sampler` (greedy, temperature, top-k, top-p, min-p, seeded rows;
vectorised over rows on the logits' device), the logits processors applied before the pick (penalties,
logit_bias, min_tokens: `logits_processors.py`, `penalties.py`), grammar token masks (`token_mask.py`), the nucleus
search (`nucleus.py`), the draw (`draw.py`, `sampling_plan.py`), and the logprobs of the sampled and prompt tokens
(`logprobs.py`, `prompt_logprobs.py`). Each part is planned on the host before the step's forward (its device inputs
into the step's one upload: engine/host_lists.py Uploads) and applied on the device after it. No KV, no model.
"""
