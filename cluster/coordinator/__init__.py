"""The Backend of disaggregated serving: one request across a prefill and a decode worker.

Runs in the serve process, on the front ends' asyncio loop. `start_cluster` launches the worker actors
(`cluster.workers`) and puts a `Coordinator` over them. Per request the coordinator routes (decode worker
by the prompt's blocks it is known to hold against its free blocks, `kv_routing.py`; prefill worker by queue
and prefix affinity), asks the decode worker to expect it (the worker pins the prompt's cached blocks and
applies the disaggregation policy's bound, `disagg_policy.py`), hands the prompt to the prefill worker with
the count of blocks not to ship (or lets the decode worker prefill it itself), and streams the
decode worker's tokens back with the timing breakdown; a `DecodeEventPump` per decode worker holds that
worker's channel (`cluster/workers/decode_channel.py`: a TCP connection past Ray) that carries its `expect`
calls and routes its events to per-request mailboxes. The other calls into the actor processes go through
Ray: `PrefillActor.prefill.remote`, and the control calls (cancel, stats, health, stop).
Colocated replicas (`--replicas N`) are the same coordinator over decode workers that prefill every prompt
themselves (no prefill workers), routed by load with prefix affinity. The workers are a `WorkerSet` that
changes while serving: `Scaling` adds and drains workers (`POST /admin/workers`, `tandem scale`) and runs
the autoscaler (`decide()` on a snapshot of the coordinator's own numbers).
"""
