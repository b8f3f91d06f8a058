"""The worker processes on Ray: actors around PrefillWorker and DecodeWorker, their placement and launch.

`actors.py` runs inside each actor process (one per worker, one GPU each on GPU nodes, a CPU share on
CPU nodes): it builds the engine there and exposes the plain worker as async actor methods
(`prefill`, `expect`, the batched `events()` stream, and the control calls `info`, `cancel`, `stats`,
`stop` in a concurrency group of their own). `placement.py`, `launch.py` and `cluster_config.py` run in
the process that starts the cluster (the serve process or a job's driver): connect to or start Ray,
reserve a placement group, start the actors and wait for their engines, and release it all again, every
Ray call of the release bounded (`bounded.py`). A local Ray started here runs in a `RayHost` process of
its own session (`ray_host.py`), so signals to the serve process's group do not reach it and it stops
when the serve process is gone. `worker_template.py` keeps how to build any worker of a started cluster and
`added_worker.py` starts (or releases) one while it serves. `tp_group.py`: a worker that is a tensor-parallel
group (its actor rank 0, the other ranks actors it starts in its own STRICT_PACK placement group).
`startup_heap.py` freezes a serving process's start-up objects out of Python's full collections once it has
started (each actor, the serve process).
Nothing here routes requests; that is `cluster.coordinator`.
"""
