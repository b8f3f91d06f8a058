"""Where a worker added while serving may go: the cluster's placement strategy, applied to one more bundle
given the nodes that hold the cluster's bundles already.

    added_placement("STRICT_SPREAD", {"CPU": 1}, held=["n1", "n2"], nodes)
    -> AddedPlacement(group_strategy="PACK", label_selector={"ray.io/node-id": "!in(n1,n2)"}, soft_target=None)
    slots = place_added_bundles("decode", {"CPU": 1}, "STRICT_SPREAD", held_slots, count=1, timeout_s=300)

A Ray placement group's strategy holds among its own bundles only, and a group cannot grow, so an added
worker gets a one-bundle group of its own (cluster/workers/added_worker.py), for which the strategy alone
says nothing. This module is the one place that decides where such a group may go. It reads the node of
every bundle the cluster holds (the start group's, a free one a drained worker left included, and each added
worker's group) and pins the new group with the `ray.io/node-id` label every Ray node carries:

| strategy      | an added worker goes to                               | how                                      |
|---------------|-------------------------------------------------------|------------------------------------------|
| STRICT_SPREAD | a node that holds none of the cluster's bundles       | hard: label selector `!in(those nodes)`  |
| STRICT_PACK   | the node that holds them all                          | hard: label selector `that node`         |
| SPREAD        | of the nodes with room for it now, one with the fewest | soft: a target node (Ray may go elsewhere) |
| PACK          | of the nodes with room for it now, one with the most  | soft: a target node                      |

Why a group with a label selector and not node affinity on the actor: the group reserves the bundle before
the actor starts and is released the same way as at start, a pending group is what asks a Ray autoscaler
for a node, and `!in(...)` lets a node that autoscaler adds qualify. Ray honours a soft target node only on
a STRICT_PACK group (one bundle is packed anyway). When no node has room now, a soft rule states no
preference. Several workers added by one call are placed one after another, each seeing the nodes of the
ones before it. Role resources (`--prefill-resources` / `--decode-resources`) are in the bundle itself, as
at start.

check_added_room says before anything starts whether the alive nodes can ever hold `count` more workers by
the rule (Scaling calls it when the role has no maximum; with a maximum the group may wait, bounded, for a
node the Ray autoscaler adds).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import ray

from cluster.workers.added_worker import BundleSlot
from cluster.workers.placement import alive_node_resources, node_name, place_bundles
from cluster.workers.placement_check import PlacementInfeasible, check_group_room, check_placement, fits, show

NODE_ID_LABEL = "ray.io/node-id"   # every Ray node's own label (ray.util.placement_group.NODE_ID_LABEL_KEY)


@dataclass(frozen=True)
class NodeRoom:
    """One alive Ray node: its address, its total resources and those free now."""

    address: str
    total: dict[str, float]
    free: dict[str, float]


@dataclass(frozen=True)
class AddedPlacement:
    """How an added worker's one-bundle group is created. label_selector: the nodes it may go to (hard;
    {} for any); soft_target: the node id Ray should try first (None: no preference); rule: what the
    strategy asks, in words (for errors)."""

    group_strategy: str
    label_selector: dict[str, str]
    soft_target: str | None
    rule: str


def added_placement(strategy: str, bundle: dict, held: list[str], nodes: dict[str, NodeRoom]) -> AddedPlacement:
    """Where the next added worker (`bundle`) may go, by `strategy`, given `held`: the node id of each
    bundle the cluster holds (one entry per bundle) and `nodes` (node id -> NodeRoom, the alive ones)."""
    occupied = sorted(set(held))
    if strategy == "STRICT_SPREAD":
        selector = {NODE_ID_LABEL: f"!in({','.join(occupied)})"} if occupied else {}
        return AddedPlacement("PACK", selector, None, "STRICT_SPREAD: on a node that holds none of this cluster's "
                              f"workers (they are on {_names(occupied, nodes)})")
    if strategy == "STRICT_PACK" and len(occupied) == 1:
        return AddedPlacement("PACK", {NODE_ID_LABEL: occupied[0]}, None,
                              f"STRICT_PACK: on the node that holds every worker ({_names(occupied, nodes)})")
    counts = Counter(held)
    roomy = [node_id for node_id, node in nodes.items() if fits(bundle, node.free)]
    if not roomy:
        return AddedPlacement("PACK", {}, None, f"{strategy}: no node has room for it now, any node")
    sign = -1 if strategy == "PACK" else 1    # PACK: where the most workers are; SPREAD: where the fewest
    target = min(roomy, key=lambda node_id: (sign * counts[node_id], node_id))
    return AddedPlacement("STRICT_PACK", {}, target, f"{strategy}: preferably on {_names([target], nodes)}, "
                          f"which holds {counts[target]} of this cluster's workers")


def check_added_room(strategy: str, role: str, bundle: dict, count: int, held: list[tuple[str, dict, str | None]],
                     nodes: dict[str, NodeRoom]) -> None:
    """PlacementInfeasible, naming what is missing, when `nodes` can never hold `count` more workers of
    `role` (`bundle` each) by `strategy` beside `held` ((role, bundle, node id or None) per bundle the
    cluster holds). Necessary, not sufficient, for PACK and SPREAD (as placement_check.check_placement)."""
    if count <= 0:
        return
    new = [(role, bundle)] * count
    occupied = {node for _, _, node in held if node is not None}
    if strategy == "STRICT_SPREAD":
        able = [node_id for node_id, node in nodes.items() if node_id not in occupied and fits(bundle, node.total)]
        if len(able) < count:
            keys = sorted(bundle)
            raise PlacementInfeasible(
                f"STRICT_SPREAD puts every worker on a node of its own: {count} more {role} worker(s) need {count} "
                f"node(s) that hold none of this cluster's {len(held)} workers and can each hold one "
                f"({show(bundle, keys)}), the Ray cluster has {len(able)} (of {len(nodes)} alive; "
                f"{len(occupied)} hold its workers): add nodes, or choose another placement strategy; nodes: "
                + ", ".join(f"{node_name(n, node.address)} {show(node.total, keys)}" for n, node in nodes.items()))
        return
    bundles = [(r, b) for r, b, _ in held] + new
    if strategy == "STRICT_PACK" and len(occupied) == 1:
        (node_id,) = occupied
        where = {node_name(node_id, nodes[node_id].address): nodes[node_id].total} if node_id in nodes else {}
        try:
            check_placement(bundles, strategy, where)
        except PlacementInfeasible as error:
            raise PlacementInfeasible(f"STRICT_PACK keeps every worker on the node that holds them: {error}") from None
        return
    check_placement(bundles, strategy, {node_name(n, node.address): node.total for n, node in nodes.items()})


def room_for_added(strategy: str, role: str, count: int, held: list[tuple[str, BundleSlot]],
                   bundles: dict[str, dict]) -> None:
    """check_added_room on the Ray cluster as it is now: `held` is (role, slot) per bundle the cluster holds,
    `bundles` the bundle of each role."""
    nodes = bundle_nodes([slot for _, slot in held])
    check_added_room(strategy, role, bundles[role], count,
                     [(r, bundles[r], node) for (r, _), node in zip(held, nodes)], alive_nodes())


def alive_nodes() -> dict[str, NodeRoom]:
    """Every alive node of the Ray cluster (node id -> NodeRoom), with what is free on it now."""
    free = ray._private.state.available_resources_per_node()
    return {node["NodeID"]: NodeRoom(node["NodeManagerAddress"], dict(node["Resources"]),
                                     dict(free.get(node["NodeID"], {})))
            for node in ray.nodes() if node.get("Alive")}


def bundle_nodes(slots: list[BundleSlot]) -> list[str | None]:
    """The node id each bundle sits on (None while Ray has not placed it, e.g. after its node died)."""
    tables: dict = {}
    for slot in slots:
        if slot.group.id not in tables:
            tables[slot.group.id] = ray.util.placement_group_table(slot.group).get("bundles_to_node_id", {})
    return [tables[slot.group.id].get(slot.index) for slot in slots]


def place_added_bundles(role: str, bundle: dict, strategy: str, held: list[BundleSlot], count: int,
                        timeout_s: float, ranks: int = 1) -> list[BundleSlot]:
    """`count` one-bundle groups for added workers of `role`, placed one after another by `strategy` beside
    the `held` bundles; each an owned BundleSlot. Waits at most timeout_s for each; on any failure removes
    the groups it placed before the error propagates: PlacementInfeasible when no alive node can ever hold
    `bundle`, RuntimeError (with the rule) when Ray did not place one in time. ranks > 1: each worker is a
    tensor-parallel group, its group `ranks` bundles STRICT_PACKed on one node (the node chosen by the same
    rule; the slot is bundle 0, rank 0's)."""
    placed: list[BundleSlot] = []
    group_bundle = {key: amount * ranks for key, amount in bundle.items()}
    if ranks > 1:
        check_group_room(role, ranks, bundle, alive_node_resources())
    try:
        for _ in range(count):
            nodes = alive_nodes()
            where = added_placement(strategy, group_bundle, [n for n in bundle_nodes([*held, *placed]) if n], nodes)
            try:
                group = place_bundles([(role, bundle)] * ranks, where.group_strategy if ranks == 1 else "STRICT_PACK",
                                      timeout_s, label_selector=where.label_selector, soft_target=where.soft_target)
            except RuntimeError as error:
                raise RuntimeError(f"{error}; an added worker goes by {where.rule}") from None
            placed.append(BundleSlot(group, 0, owned=True))
    except BaseException:
        for slot in placed:
            ray.util.remove_placement_group(slot.group)
        raise
    return placed


def _names(node_ids: list[str], nodes: dict[str, NodeRoom]) -> str:
    return ", ".join(node_name(n, nodes[n].address if n in nodes else "gone") for n in node_ids) or "no node"
