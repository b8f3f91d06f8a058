"""The placement pre-check on its own (no Ray): what a cluster of given nodes can never hold, the flags that
feed it, and where a worker added while serving may go by the placement strategy. Placement on real Ray
nodes: tests/cluster/multinode/ (test_multinode.py and test_multinode_scaling.py)."""
from __future__ import annotations

import argparse

import pytest

from cluster.serve import add_arguments, cluster_config, config_from_args
from cluster.workers.added_placement import NODE_ID_LABEL, NodeRoom, added_placement, check_added_room
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


def room(total: dict, free: dict | None = None) -> NodeRoom:
    return NodeRoom("10.0.0.1", total, total if free is None else free)


def test_where_an_added_worker_goes_follows_the_strategy():
    """Hard rules pin the added worker's one-bundle group by node id; soft ones name a node with room now."""
    nodes = {"n1": room({"CPU": 4}, {"CPU": 2}), "n2": room({"CPU": 2}, {"CPU": 1}), "n3": room({"CPU": 2}),
             "n4": room({"CPU": 2}, {"CPU": 0})}
    held = ["n2", "n1", "n1", "n4"]
    spread = added_placement("STRICT_SPREAD", {"CPU": 1}, held, nodes)
    assert (spread.label_selector, spread.soft_target) == ({NODE_ID_LABEL: "!in(n1,n2,n4)"}, None)
    assert added_placement("STRICT_SPREAD", {"CPU": 1}, [], nodes).label_selector == {}
    assert added_placement("STRICT_PACK", {"CPU": 1}, ["n1", "n1"], nodes).label_selector == {NODE_ID_LABEL: "n1"}
    pack, soft_spread = (added_placement(s, {"CPU": 1}, held, nodes) for s in ("PACK", "SPREAD"))
    assert (pack.group_strategy, pack.label_selector, pack.soft_target) == ("STRICT_PACK", {}, "n1")
    assert (soft_spread.soft_target, soft_spread.label_selector) == ("n3", {})      # n4 holds 1 but has no room
    assert added_placement("SPREAD", {"CPU": 1}, ["n1", "n2", "n3"], nodes).soft_target == "n1"   # 1 each: by id
    full = added_placement("PACK", {"CPU": 3}, held, nodes)
    assert (full.soft_target, full.label_selector, full.group_strategy) == (None, {}, "PACK")


def test_room_for_added_workers_is_checked_by_the_configured_strategy():
    """The same cluster and workers: PACK has room for two more; STRICT_SPREAD only on a node holding none of
    them (role resources included); STRICT_PACK only on the node that holds them all."""
    nodes = {"n1": room({"CPU": 4}), "n2": room({"CPU": 2, "decode_pool": 1}), "n3": room({"CPU": 1})}
    held = [("prefill", {"CPU": 1}, "n1"), ("decode", {"CPU": 1}, "n2")]
    check_added_room("PACK", "decode", {"CPU": 1}, 2, held, nodes)
    check_added_room("STRICT_SPREAD", "decode", {"CPU": 1}, 1, held, nodes)
    with pytest.raises(PlacementInfeasible, match=r"STRICT_SPREAD puts every worker on a node of its own: 2 more "
                                                  r"decode worker\(s\) need 2 node\(s\) that hold none of this "
                                                  r"cluster's 2 workers .* has 1 \(of 3 alive; 2 hold its workers\)"):
        check_added_room("STRICT_SPREAD", "decode", {"CPU": 1}, 2, held, nodes)
    with pytest.raises(PlacementInfeasible, match=r"\(\{CPU: 1, decode_pool: 1\}\), the Ray cluster has 0"):
        check_added_room("STRICT_SPREAD", "decode", {"CPU": 1, "decode_pool": 1}, 1, held, nodes)
    packed = [("prefill", {"CPU": 1}, "n1"), ("decode", {"CPU": 1}, "n1")]
    check_added_room("STRICT_PACK", "decode", {"CPU": 1}, 2, packed, nodes)
    with pytest.raises(PlacementInfeasible, match=r"STRICT_PACK keeps every worker on the node that holds them: "
                                                  r"STRICT_PACK puts all 5 workers on one node: they need \{CPU: 5\}"):
        check_added_room("STRICT_PACK", "decode", {"CPU": 1}, 3, packed, nodes)
    check_added_room("PACK", "decode", {"CPU": 1}, 3, packed, nodes)
    check_added_room("STRICT_SPREAD", "decode", {"CPU": 1}, 0, held, {})    # a free start-group bundle: no node
