"""Sender side of one transfer: describe the request's runs in a manifest, gather them into staging."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.checksum import checksum_blocks
from kv_transfer.device_sync import copy_stream
from kv_transfer.manifest import Manifest, RunInfo, encode_manifest
from kv_transfer.pool import KVPoolView
from kv_transfer.results import SendRequest
from kv_transfer.runs import BlockRun, gather_run, group_runs, staging_offsets
from kv_transfer.staging import StagingPool


@dataclass
class OutgoingTransfer:
    """A transfer ready for the wire. run_payloads[i] (flat uint8 in staging) holds the bytes of
    manifest.runs[i] once gather(i) has run; the manifest's checksums were taken from the pool."""

    manifest: Manifest
    manifest_bytes: bytes
    pool: KVPoolView
    runs: list[BlockRun]
    staging: torch.Tensor
    run_payloads: list[torch.Tensor]
    gathered: list[bool]

    def gather(self, index: int) -> None:
        """Copies run `index` from the pool into its staging piece once (complete on return)."""
        if self.gathered[index]:
            return
        with copy_stream(self.pool.device):
            gather_run(self.pool.kv, self.runs[index], self.run_payloads[index], self.manifest.fingerprint)
        self.gathered[index] = True

    def gather_all(self) -> None:
        for index in range(len(self.runs)):
            self.gather(index)


def prepare_outgoing(pool: KVPoolView, request: SendRequest, staging_pool: StagingPool,
                     ready_event: "torch.cuda.Event | None" = None, max_run_bytes: int = 0) -> OutgoingTransfer:
    """Splits request.block_ids into runs (at most max_run_bytes each, 0: unbounded), checksums each
    run straight from the pool and builds the manifest; reserves staging but gathers nothing yet.
    Reads the pool, changes nothing in it."""
    fp = pool.fingerprint
    runs = group_runs(request.block_ids, max(1, max_run_bytes // fp.block_nbytes) if max_run_bytes else 0)
    with copy_stream(pool.device, after=ready_event):
        sums = [checksum_blocks(pool.kv[:, :, run.start : run.start + run.num_blocks]) for run in runs]
    infos = tuple(RunInfo(r.start, r.num_blocks, r.num_blocks * fp.block_nbytes, s) for r, s in zip(runs, sums))
    manifest = Manifest(request_id=request.request_id, fingerprint=fp, num_tokens=request.num_tokens,
                        block_ids=tuple(request.block_ids), first_token=request.first_token, runs=infos)
    offsets, total = staging_offsets([info.nbytes for info in infos])
    staging = staging_pool.acquire(total)
    payloads = [staging[off : off + info.nbytes] for off, info in zip(offsets, infos)]
    return OutgoingTransfer(manifest, encode_manifest(manifest), pool, runs, staging, payloads, [False] * len(runs))
