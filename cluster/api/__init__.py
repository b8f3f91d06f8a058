"""The front ends users talk to: gRPC (`tandem.v1.Tandem`) and the OpenAI-compatible HTTP API.

Runs in the serve process (`tandem serve`, or the driver of `tandem demo` / a Ray job), on its asyncio
loop. Parses and validates wire requests (bad input -> 400 / INVALID_ARGUMENT before anything is
queued; large ones on the bounded threads of `input_pool.py`, tokenized by `prompt_encoder.py`), turns them
into a `cluster.backend.GenerationRequest`, and writes the backend's chunks back as gRPC messages, SSE events
or JSON bodies; checks the API key and records the Prometheus metrics
(`/metrics`); `admission.py` bounds the requests in the system (`--max-pending-requests`, every mode);
`grpc_operators.py` adds the standard gRPC health (following the backend) and reflection services;
`draining_backend.py` ends requests in flight with "the server is stopping" when `tandem serve` stops.
It knows only the Backend contract: never an engine, a worker or Ray. The one call that crosses into the
next layer is `Backend.generate(request)`.
"""
