"""Decode workers: receive prompt KV, admit it, decode with continuous batching, stream tokens.

    worker = DecodeWorker(engine, DecodeWorkerConfig(name="decode-0", transport="grpc"))
    worker.address                                   # give this to the prefill worker
    worker.expect(ExpectedRequest(rid, prompt_ids, params), emit)   # Admission; events go to emit

DecodeWorkerConfig(transport="none"): no KV receiver; the worker prefills every request itself (a colocated
replica). No Ray in here: cluster/workers/actors.py wraps a worker in a Ray actor; tests run it bare.
"""
from decode_worker.config import DecodeWorkerConfig
from decode_worker.messages import (Admission, DecodeChunk, DecodeEnded, DecodeEvent, DecodeStats, DecodeStatus,
                                    ExpectedRequest, is_final)
from decode_worker.worker import DecodeWorker

__all__ = ["DecodeWorker", "DecodeWorkerConfig", "ExpectedRequest", "Admission", "DecodeChunk", "DecodeEnded",
           "DecodeEvent", "DecodeStats", "DecodeStatus", "is_final"]
