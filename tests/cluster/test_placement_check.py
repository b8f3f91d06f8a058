"""The placement pre-check on its own (no Ray): what a cluster of given nodes can never hold, and the
flags that feed it. Placement on real Ray nodes: tests/cluster/test_multinode.py."""
from __future__ import annotations

import argparse

import pytest

from cluster.serve import add_arguments, cluster_config, config_from_args
from cluster.workers.cluster_config import ClusterConfig
from cluster.workers.placement_check import PlacementInfeasible, check_placement, role_resources, worker_bundles

NODES = {"head": {"CPU": 0}, "n1": {"CPU": 2, "GPU": 1, "prefill_pool": 4},
         "n2": {"CPU": 2, "GPU": 1, "decode_pool": 4}}


def bundles(num_prefill: int, num_decode: int, cpu: int = 1, gpus: float = 0, prefill=None, decode=None):
    return worker_bundles([("prefill", num_prefill, prefill or {}), ("decode", num_decode, decode or {})], cpu, gpus)


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
def test_what_fits_passes(strategy):
    check_placement(bundles(1, 1), strategy, NODES)
    check_placement(bundles(1, 1, gpus=1, prefill={"prefill_pool": 1}, decode={"decode_pool": 1}),
                    "STRICT_SPREAD", NODES)


@pytest.mark.parametrize("workers, strategy, message", [
    (bundles(2, 1), "STRICT_SPREAD", r"STRICT_SPREAD puts every worker on a node of its own: 3 workers need 3 "
                                     r"nodes .* has 2 such nodes \(of 3 alive\)"),
    (bundles(2, 1, prefill={"prefill_pool": 1}, decode={"decode_pool": 1}), "STRICT_SPREAD",
     r"2 prefill workers need 2 nodes that can each hold one \(\{CPU: 1, prefill_pool: 1\}\), the Ray cluster has 1"),
    (bundles(2, 1, gpus=1), "PACK", r"3 workers need more than the Ray cluster has: GPU 3 \(the cluster has 2\)"),
    (bundles(1, 1, gpus=1), "STRICT_PACK", r"STRICT_PACK .* they need \{CPU: 2, GPU: 2\} together"),
    (bundles(1, 1, cpu=3), "PACK", r"can hold a prefill worker, which needs \{CPU: 3\}: CPU: needs 3, the largest "
                                   r"node has 2"),
    (bundles(1, 1, decode={"gpu_pool": 1}), "SPREAD", r"hold a decode worker.*gpu_pool: needs 1, no node has it"),
    (bundles(1, 1), "PACK", r"hold a prefill worker.*nodes: none alive"),
])
def test_what_can_never_fit_is_named(workers, strategy, message):
    nodes = {} if message.endswith("none alive") else NODES
    with pytest.raises(PlacementInfeasible, match=message):
        check_placement(workers, strategy, nodes)


def test_role_resources_are_a_json_object_of_custom_resources():
    assert role_resources('{"prefill_pool": 2}', "--prefill-resources") == {"prefill_pool": 2.0}
    assert role_resources(None, "--prefill-resources") == {} == role_resources("", "--x")
    for bad, why in [("[1]", "JSON object"), ("{oops", "JSON object"), ('{"GPU": 1}', "not a custom resource"),
                     ('{"pool": 0}', "must be a number > 0"), ('{"pool": "1"}', "must be a number > 0")]:
        with pytest.raises(ValueError, match=why):
            role_resources(bad, "--decode-resources")
    with pytest.raises(ValueError, match="decode_resources: 'CPU'"):
        ClusterConfig(decode_resources={"CPU": 1})


def test_serve_flags_reach_the_cluster_config():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args([
        "--prefill-workers", "1", "--address", "127.0.0.2:6379", "--node-ip-address", "127.0.0.2",
        "--prefill-resources", '{"prefill_pool": 1}', "--decode-resources", '{"decode_pool": 0.5}']))
    assert (config.address, config.node_ip_address) == ("127.0.0.2:6379", "127.0.0.2")
    cluster = cluster_config(config)
    assert (cluster.prefill_resources, cluster.decode_resources) == ({"prefill_pool": 1.0}, {"decode_pool": 0.5})
    with pytest.raises(ValueError, match="--node-ip-address .* give both"):
        config_from_args(parser.parse_args(["--prefill-workers", "1", "--node-ip-address", "127.0.0.2"]))
    with pytest.raises(ValueError, match="need --mode disaggregated"):
        config_from_args(parser.parse_args(["--prefill-resources", '{"p": 1}']))
