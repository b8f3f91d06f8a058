"""What a served request's Timing guarantees, whatever the load (cluster/backend.py Timing).

The first token is sampled by the prefill step and handed back after it, so the time to first token covers the
queue and the prefill. It need not cover transfer_ms: that ends when the prefill worker reads the decode worker's
acknowledgement, which a busy prefill process can read after the decode side already streamed the first token."""
from __future__ import annotations

# Timing's fields are differences of the same monotonic clock, in ms; this absorbs their rounding only.
CLOCK_ROUNDING_MS = 1e-3


def assert_remote_prefill_timing(timing) -> None:
    """`timing` (a Timing, a gRPC Timing or HTTP tandem_timing as a dict) of a request whose KV was shipped."""
    get = timing.get if isinstance(timing, dict) else lambda name: getattr(timing, name)
    assert get("queue_ms") >= 0 and get("prefill_ms") > 0, timing
    assert get("ttft_ms") + CLOCK_ROUNDING_MS >= get("queue_ms") + get("prefill_ms"), timing
    assert get("transfer_ms") > 0 and get("kv_bytes") > 0, timing
