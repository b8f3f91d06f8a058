"""The engine's step loop: `LLMEngine` (the request API and `step`), the `Scheduler` that picks each step's
tokens, `fork_sequence` for the samples of an `n` > 1 request, what admission checks (`request_checks.py`),
the counters (`stats.py`), and how the thread that owns an engine reads its commands between steps
(`command_queue.py`, `step_watch.py`, `step_observer.py`). It drives runner/ (one forward per step), kv/ (the
blocks) and sampling/ (the picks), and hands back results/ (`engine/outputs.py`). Runs in whatever process
owns the engine: a worker actor's step thread, the colocated serve process's engine thread, an `LLM` user.
"""
