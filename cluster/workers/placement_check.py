"""Whether a Ray cluster can ever hold the workers' placement-group bundles, checked before anything starts.

    check_placement([("prefill", {"CPU": 1}), ("decode", {"CPU": 1})], "STRICT_SPREAD",
                    {"a1b2c3d4 (10.0.0.5)": {"CPU": 8, "GPU": 1}})
    -> PlacementInfeasible: STRICT_SPREAD puts every worker on a node of its own: ...

Pure functions over the resources of the cluster's nodes (cluster/workers/placement.py reads them from Ray),
so that a strategy Ray cannot satisfy (STRICT_SPREAD with more workers than nodes, more GPUs than exist, a
custom resource no node has) is an error naming what is missing instead of a placement group left pending.
What it checks is necessary, not sufficient for PACK and SPREAD (it does not solve the bin packing): what
passes it and still cannot be placed ends in create_placement_group's bounded wait.

Role resources (`--prefill-resources` / `--decode-resources`) are custom Ray resources added to each
worker's bundle of that role, so a node pool started with e.g. `ray start --resources '{"prefill_pool": 8}'`
runs that role's workers.
"""
from __future__ import annotations

import json

RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
EPS = 1e-9


class PlacementInfeasible(ValueError):
    """The Ray cluster cannot hold the workers with the strategy asked for, however long one waits."""


def role_resources(text: str | None, flag: str) -> dict[str, float]:
    """The custom resources of a `--prefill-resources` / `--decode-resources` JSON object, checked
    (ValueError naming `flag`); {} for None or an empty string."""
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag} must be a JSON object of resource name -> amount, e.g. "
                         f"'{{\"prefill_pool\": 1}}': {error}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{flag} must be a JSON object of resource name -> amount, got {text!r}")
    check_role_resources(parsed, flag)
    return {str(name): float(amount) for name, amount in parsed.items()}


def check_role_resources(resources: dict, what: str) -> None:
    """ValueError unless every entry is a custom resource name with a positive amount."""
    for name, amount in resources.items():
        if not isinstance(name, str) or not name or name in RESERVED_RESOURCES or name.startswith("node:"):
            raise ValueError(f"{what}: {name!r} is not a custom resource name (CPU and GPU come from "
                             f"--cpu-threads and --gpus-per-worker)")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise ValueError(f"{what}: the amount of {name!r} must be a number > 0, got {amount!r}")


def worker_bundles(roles: list[tuple[str, int, dict[str, float]]], cpu_threads: int, gpus: float):
    """(role, bundle) per worker, roles in the order given ((role, count, custom resources) each):
    {CPU: threads[, GPU: gpus]} plus the role's custom resources."""
    base = {"CPU": cpu_threads, "GPU": gpus} if gpus else {"CPU": cpu_threads}
    return [(role, {**base, **resources}) for role, count, resources in roles for _ in range(count)]


def check_placement(bundles: list[tuple[str, dict]], strategy: str, nodes: dict[str, dict]) -> None:
    """PlacementInfeasible, naming what is missing, when `nodes` (name -> total resources of each alive
    node) can never hold `bundles` ((role, resources) per worker) with `strategy`."""
    keys = sorted({key for _, bundle in bundles for key in bundle})
    where = "; nodes: " + (", ".join(f"{name} {show(res, keys)}" for name, res in nodes.items()) or "none alive")
    for role, bundle in _distinct(bundles):
        if not any(fits(bundle, res) for res in nodes.values()):
            raise PlacementInfeasible(f"no node of the Ray cluster can hold a {role} worker, which needs "
                                      f"{show(bundle, sorted(bundle))}: {_missing(bundle, nodes)}{where}")
    if strategy == "STRICT_SPREAD":
        _check_spread(bundles, nodes, where)
    total = _sum(bundle for _, bundle in bundles)
    if strategy == "STRICT_PACK" and not any(fits(total, res) for res in nodes.values()):
        raise PlacementInfeasible(f"STRICT_PACK puts all {len(bundles)} workers on one node: they need "
                                  f"{show(total, keys)} together, no node has that much{where}")
    cluster = _sum(nodes.values())
    short = [key for key in keys if total.get(key, 0) > cluster.get(key, 0) + EPS]
    if short:
        need = ", ".join(f"{key} {total[key]:g} (the cluster has {cluster.get(key, 0):g})" for key in short)
        raise PlacementInfeasible(f"{len(bundles)} workers need more than the Ray cluster has: {need}{where}")


def check_group_room(role: str, ranks: int, bundle: dict, nodes: dict[str, dict]) -> None:
    """PlacementInfeasible when no node of `nodes` (name -> total resources) can hold a worker of `role` that is a
    tensor-parallel group of `ranks` ranks: its bundles (one per rank) go on one node together (STRICT_PACK)."""
    total = {key: amount * ranks for key, amount in bundle.items()}
    if any(fits(total, res) for res in nodes.values()):
        return
    keys = sorted(total)
    device = "GPUs" if bundle.get("GPU") else "CPUs"
    raise PlacementInfeasible(
        f"a {role} worker of tensor-parallel size {ranks} runs its {ranks} ranks on one node (one bundle each, "
        f"{show(bundle, keys)}): it needs {show(total, keys)} on one node, more {device} than any node has "
        f"({_missing(total, nodes)}); give a smaller tensor-parallel size or fewer CPU threads per rank; nodes: "
        + (", ".join(f"{name} {show(res, keys)}" for name, res in nodes.items()) or "none alive"))


def _check_spread(bundles: list[tuple[str, dict]], nodes: dict[str, dict], where: str) -> None:
    """STRICT_SPREAD: every bundle on a node of its own, per role and all together."""
    rule = "STRICT_SPREAD puts every worker on a node of its own: "
    advice = "add nodes, start fewer workers, or choose another placement strategy"
    for role, bundle in _distinct(bundles):
        count = sum(1 for other in bundles if other == (role, bundle))
        able = sum(1 for res in nodes.values() if fits(bundle, res))
        if able < count:
            raise PlacementInfeasible(f"{rule}{count} {role} workers need {count} nodes that can each hold one "
                                      f"({show(bundle, sorted(bundle))}), the Ray cluster has {able}: {advice}{where}")
    placed = _distinct_nodes(bundles, nodes)
    if placed < len(bundles):
        raise PlacementInfeasible(f"{rule}{len(bundles)} workers need {len(bundles)} nodes that can each hold one, "
                                  f"the Ray cluster has {placed} such nodes (of {len(nodes)} alive): {advice}{where}")


def fits(bundle: dict, resources: dict) -> bool:
    """Whether `resources` hold all of `bundle`."""
    return all(resources.get(key, 0) + EPS >= amount for key, amount in bundle.items())


def _sum(resource_dicts) -> dict[str, float]:
    total: dict[str, float] = {}
    for resources in resource_dicts:
        for key, amount in resources.items():
            total[key] = total.get(key, 0) + amount
    return total


def _distinct(bundles: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    seen: list[tuple[str, dict]] = []
    for role, bundle in bundles:
        if (role, bundle) not in seen:
            seen.append((role, bundle))
    return seen


def _missing(bundle: dict, nodes: dict[str, dict]) -> str:
    """What no single node has enough of, e.g. "GPU: needs 1, the largest node has 0"."""
    parts = []
    for key, amount in bundle.items():
        largest = max((res.get(key, 0) for res in nodes.values()), default=0)
        if largest + EPS < amount:
            parts.append(f"{key}: needs {amount:g}, the largest node has {largest:g}" if largest
                         else f"{key}: needs {amount:g}, no node has it")
    return "; ".join(parts) or "no node has all of it at once"


def _distinct_nodes(bundles: list[tuple[str, dict]], nodes: dict[str, dict]) -> int:
    """How many bundles can sit on distinct nodes at most (bipartite matching, augmenting paths)."""
    able = [[name for name, res in nodes.items() if fits(bundle, res)] for _, bundle in bundles]
    owner: dict[str, int] = {}

    def assign(index: int, visited: set[str]) -> bool:
        for name in able[index]:
            if name not in visited:
                visited.add(name)
                if name not in owner or assign(owner[name], visited):
                    owner[name] = index
                    return True
        return False

    return sum(assign(index, set()) for index in range(len(bundles)))


def show(resources: dict, keys: list[str]) -> str:
    """{CPU: 1, GPU: 0} over `keys` (the resources the bundles ask for)."""
    return "{" + ", ".join(f"{key}: {resources.get(key, 0):g}" for key in keys) + "}"
