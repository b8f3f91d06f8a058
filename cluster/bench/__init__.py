"""Everything `tandem bench` runs, except the transfer benchmark (kv_transfer/bench.py).

`engine_vs_hf.py` (+ `limits.py`, `peer_vllm.py`): engine.LLM against transformers (and vLLM's CPU build
through a peer runner) in the bench process. `serve*.py`: a `vllm bench serve`-style HTTP load client
against any running OpenAI-compatible server. `compare*.py`: starts `tandem serve` subprocesses in each
serving mode in turn and runs the same workload against each. `checkpoint.py` builds the seeded random
checkpoints they share. `sampler.py`: the engine's sampler alone, ms per call per sampling mode. `load.py`:
a model's load time to its first token in fresh processes. Only client processes live here: the servers they measure are real
`tandem serve` processes.
"""
