"""Prefill workers: batched prompt ingestion -> first token + KV blocks -> kv_transfer to a decode worker.

    worker = PrefillWorker(engine, PrefillWorkerConfig(name="prefill-0", transport="grpc"))
    report = worker.submit(PrefillTask(request_id, prompt_ids, params, decode_address)).result()

No Ray in here: cluster/workers/actors.py wraps a worker in a Ray actor; tests run it bare.
"""
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.messages import PrefillReport, PrefillStats, PrefillStatus, PrefillTask
from prefill_worker.worker import PrefillWorker

__all__ = ["PrefillWorker", "PrefillWorkerConfig", "PrefillTask", "PrefillReport", "PrefillStatus",
           "PrefillStats"]
