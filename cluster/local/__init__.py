"""The in-process Backend: one engine in the serve process does prefill and decode (colocated serving).

`LocalEngineBackend` runs on the front ends' asyncio loop (admission, per-request queues);
`EngineLoop` is the one thread that owns the `LLMEngine` and runs its step loop, taking submit/abort
commands between steps and handing each step's deltas back to the loop. No Ray, no other process: the
call that crosses threads is `EngineLoop.submit`, and chunks come back with `call_soon_threadsafe`.
"""
