"""One forward pass per step on the device: `ModelRunner` builds the packed varlen batch from the scheduled
chunks (ids, positions, attention metadata), runs the model or replays a captured decode CUDA graph
(`decode_graphs.py`), and samples only the rows that need a token; `memory_plan.py` sizes the KV pool from
measured device memory before the pool exists. Knows nothing of requests' lifetimes: that is core/.
"""
