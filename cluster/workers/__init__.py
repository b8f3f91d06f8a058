"""The worker processes on Ray: actors around PrefillWorker and DecodeWorker, their placement and launch.

`actors.py` runs inside each actor process (one per worker, one GPU each on GPU nodes, a CPU share on
CPU nodes): it builds the engine there and exposes the plain worker as async actor methods
(`prefill`, `expect`, the batched `events()` stream, `cancel`, `stats`, `stop`). `placement.py`,
`launch.py` and `cluster_config.py` run in the process that starts the cluster (the serve process or a
job's driver): connect to or start Ray, reserve a placement group, start the actors and wait for their
engines, and release it all again. Nothing here routes requests; that is `cluster.coordinator`.
"""
