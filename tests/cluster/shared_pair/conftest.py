"""The cluster shared by the tests of this package: 1 prefill + 1 decode worker of the tiny Llama checkpoint on the
session's local Ray, KV over gRPC on 127.0.0.1, a 4 MiB KV pool per engine (512 blocks).

Starting such a cluster and stopping it costs ~8 s on the 2-core CI machine, and test_end_to_end.py and
test_structured_on_ray.py each started one of the same configuration: it is started once for the package and
checked released (running_cluster) after its last test. Shared by the package: tests here must not kill, stop,
add or drain workers, nor change the coordinator's configuration, and each ends with every pool empty (both
modules wait until idle and check it). What one module leaves is the prefix caches' content, which changes no
output: served tokens are exact with or without a cache hit, and their prompts share no block (other seeds).
"""
from __future__ import annotations

import pytest

from cluster.workers.cluster_config import ClusterConfig
from engine import EngineConfig
from tests.cluster.shared_pair import POOL_BYTES
from tests.support.cluster_rig import running_cluster


@pytest.fixture(scope="package")
def llama_checkpoint(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="package")
def llama_pair(llama_checkpoint):
    """The Coordinator of the shared 1 prefill + 1 decode cluster (see the module docstring for its contract)."""
    config = ClusterConfig(model=llama_checkpoint, device="cpu", num_prefill_workers=1, num_decode_workers=1,
                           transport="grpc", engine=EngineConfig(kv_cache_memory=POOL_BYTES),
                           expect_timeout_s=30.0, worker_start_timeout_s=60.0)
    with running_cluster(config) as coordinator:
        yield coordinator
