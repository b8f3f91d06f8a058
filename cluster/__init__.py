"""Tandem's serving layer: everything between a client and the workers, and the `tandem` command.

Rooms (each subpackage's docstring says which process it runs in):
    backend.py     the Backend contract between the front ends and whatever generates tokens
    api/           gRPC and OpenAI-compatible HTTP front ends, request validation, metrics (serve process)
    coordinator/   the disaggregated Backend: routing, request flows, decode event pumps (serve process)
    workers/       Ray actors around the prefill and decode workers, placement, launch (actor processes)
    local/         the in-process engine Backend and its step thread (serve process)
    drivers/       `tandem demo` and the `ray job submit` job: a workload through the gRPC front end
    bench/         everything `tandem bench` runs
    selftest/      `tandem selftest`: kernels, greedy vs transformers, limits, transports (no Ray needed)
    cli.py, serve.py, client.py    the entry points: `tandem`, `tandem serve`, `tandem client`

Imports point down: cli/serve -> {api, coordinator, local, drivers, bench}; coordinator -> workers;
api, coordinator, local -> backend.py; workers -> prefill_worker, decode_worker, kv_transfer, engine.
tests/test_import_direction.py keeps it so.
"""
