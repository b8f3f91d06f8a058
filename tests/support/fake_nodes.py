"""Several Ray nodes on one machine (ray.cluster_utils.Cluster), for placement across nodes.

Every node's raylet is its own Ray node with its own resources; all of them use NODE_IP, 127.0.0.2: Ray
rewrites a 127.0.0.1 join address to the host's routable address, which the tests must not use. The head
has no CPU (nothing is placed there; the driver attaches to it); each worker node has 1 CPU, one logical
GPU with a CUDA_VISIBLE_DEVICES of its own (GPUs there exercise placement only: engines run on CPU), and
the custom resources of its pool: node "a" is the prefill pool, "b" and "c" the decode pool. Where the Ray
dashboard can run (`pip install "ray[default]"`, the jobs extra) the head runs it, on 127.0.0.2 and a free
port, and its job agent on a free port too, for `ray job submit`.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from multiprocessing import forkserver, resource_tracker

import ray
from ray.cluster_utils import Cluster

from tests.support.ray_start import start_ray
from tests.support.serve_process import descendants, live_processes

NODE_IP = "127.0.0.2"
PREFILL_POOL, DECODE_POOL = "tandem_prefill_pool", "tandem_decode_pool"
NODE_POOLS = {"a": {PREFILL_POOL: 4}, "b": {DECODE_POOL: 4}, "c": {DECODE_POOL: 4}}
VISIBLE_GPUS = {"a": "3", "b": "5", "c": "6"}   # each fake node's own CUDA_VISIBLE_DEVICES


@dataclass
class FakeCluster:
    cluster: Cluster
    nodes: dict[str, object]        # name -> ray._private.node.Node
    dashboard_url: str | None       # http://127.0.0.2:PORT of the job server, None without the dashboard

    @property
    def address(self) -> str:
        return self.cluster.address

    def node_ids(self) -> dict[str, str]:
        """Node name -> Ray node id (hex)."""
        return {name: node.node_id for name, node in self.nodes.items()}

    def name_of(self, node_id: str) -> str:
        return next(name for name, node in self.nodes.items() if node.node_id == node_id)

    def add(self, name: str) -> None:
        """Starts (or starts again, after remove) the worker node `name`."""
        self.nodes[name] = self.cluster.add_node(num_cpus=1, num_gpus=1, resources=NODE_POOLS[name],
                                                 node_ip_address=NODE_IP,
                                                 env_vars={"CUDA_VISIBLE_DEVICES": VISIBLE_GPUS[name]})

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name))


def start_fake_cluster() -> FakeCluster:
    """The head and nodes a, b, c, up and registered; this process connected to it as a driver (tried
    twice if Ray's node startup times out: tests/support/ray_start.py)."""
    return start_ray(_start_fake_cluster)


def _start_fake_cluster() -> FakeCluster:
    ray.shutdown()  # the session's local Ray (tests/support/cluster_rig.py), if it runs: one Ray per driver
    dashboard = ray._private.utils.get_dashboard_dependency_error() is None
    head = {"num_cpus": 0, "node_ip_address": NODE_IP, "include_dashboard": dashboard}
    if dashboard:  # free ports: another Ray on this machine (a test worker's, a user's) may hold Ray's defaults
        head.update(dashboard_host=NODE_IP, dashboard_port=0, dashboard_agent_listen_port=0)
    cluster = Cluster(initialize_head=True, head_node_args=head)
    fake = FakeCluster(cluster, {}, f"http://{cluster.head_node.webui_url}" if dashboard else None)
    try:
        for name in NODE_POOLS:
            fake.add(name)
        fake.cluster.wait_for_nodes()
        ray.init(address=fake.address, _node_ip_address=NODE_IP, log_to_driver=False)
    except BaseException:
        fake.cluster.shutdown()
        raise
    return fake


RESOURCE_TRACKER = "multiprocessing.resource_tracker"


def stop_fake_cluster(fake: FakeCluster, timeout_s: float = 20.0) -> None:
    """Disconnects, removes every node, and fails naming any process of the cluster still alive after
    timeout_s (raylets, GCS, workers: every process this test process started below it)."""
    started = descendants(os.getpid()) - lives_with_this_process()
    ray.shutdown()
    fake.cluster.shutdown()
    left = wait_gone(started, timeout_s)
    for pid in [pid for pid, command in left.items() if RESOURCE_TRACKER in command]:
        os.kill(pid, signal.SIGKILL)  # Python's, started by Ray's dashboard: it ends once its pipe's holders all
        del left[pid]                 # have, which a dashboard child may outlive (seen once in CI); not ours
    assert not left, f"processes of the fake cluster outlived it: {left}"


def lives_with_this_process() -> set[int]:
    """Python's helper processes that serve this process until it exits, started by whatever used them first: the
    resource tracker and the fork server (tests/support/child_processes.py, tensor-parallel followers)."""
    pids = {resource_tracker._resource_tracker._pid, forkserver._forkserver._forkserver_pid}
    return {pid for pid in pids if pid is not None}


def wait_gone(pids: set[int], timeout_s: float) -> dict[int, str]:
    """Waits until none of `pids` is alive; returns those left (pid -> command line) at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = {pid: info.command for pid, info in live_processes().items() if pid in pids}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def alive_actors() -> list[str]:
    """Class names of the cluster's actors that are not dead (any job)."""
    return [actor["ActorClassName"] for actor in ray._private.state.actors().values() if actor["State"] != "DEAD"]


def live_placement_groups() -> list[dict]:
    return [group for group in ray.util.placement_group_table().values() if group["state"] != "REMOVED"]


def assert_released(worker_pids: set[int], timeout_s: float = 20.0) -> None:
    """Nothing of a stopped cluster is left: no actor alive, no placement group, no worker process."""
    deadline = time.monotonic() + timeout_s
    while (alive_actors() or live_placement_groups()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive_actors(), f"actors left: {alive_actors()}"
    assert not live_placement_groups(), f"placement groups left: {live_placement_groups()}"
    left = wait_gone(worker_pids, max(1.0, deadline - time.monotonic()))
    assert not left, f"worker processes left: {left}"
