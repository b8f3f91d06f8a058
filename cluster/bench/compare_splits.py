"""The P:D splits of a budget of devices, and their names: shared by `tandem bench compare` (its equal-hardware
set of modes) and `tandem plan` (cluster/plan/deployment.py), so that both name and count a split alike.

    colocated-R[-tpT]              R replicas of T ranks each: R x T devices
    disagg-PpDd[-ptpA][-dtpB]      P prefill workers of A ranks + D decode workers of B ranks: P x A + D x B devices

A device is a GPU (one per rank), or on CPU a rank's share of the cores. A TP size of 1 is left out of a name, so
TP=1 names are the names of before tensor parallelism.
"""
from __future__ import annotations


def deployment_name(num_prefill: int, num_decode: int, prefill_tp: int = 1, decode_tp: int = 1) -> str:
    """The mode name of a deployment (num_prefill 0: colocated replicas of decode_tp ranks)."""
    if not num_prefill:
        return f"colocated-{num_decode}" + (f"-tp{decode_tp}" if decode_tp > 1 else "")
    return (f"disagg-{num_prefill}p{num_decode}d" + (f"-ptp{prefill_tp}" if prefill_tp > 1 else "")
            + (f"-dtp{decode_tp}" if decode_tp > 1 else ""))


def check_tp_sizes(devices: int, prefill_tp: int = 1, decode_tp: int = 1, replica_tp: int = 1,
                   unit: str = "devices") -> None:
    """ValueError, naming the flag, unless the budget is >= 1, every TP size is an integer >= 1 that divides it,
    and one prefill and one decode worker fit in it together (when devices >= 2). Changes nothing."""
    if devices < 1:
        raise ValueError(f"--gpus/--workers must be >= 1 (the {unit} to split), got {devices}")
    for flag, size in (("--prefill-tp", prefill_tp), ("--decode-tp", decode_tp), ("--tp", replica_tp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {size!r}")
        if devices % size:
            raise ValueError(f"{flag} {size} does not divide the budget of {devices} {unit}: every worker of TP "
                             f"size {size} takes {size} {unit}")
    if devices >= 2 and prefill_tp + decode_tp > devices:
        raise ValueError(f"--prefill-tp {prefill_tp} + --decode-tp {decode_tp} is more than the {devices} {unit}: "
                         "a split needs one prefill and one decode worker at least")


def splits(devices: int, prefill_tp: int = 1, decode_tp: int = 1) -> list[tuple[int, int]]:
    """Every (P, D), P = 1, 2, ..., with P x prefill_tp + D x decode_tp <= devices that leaves no room for one
    more worker of either role (the most decode workers beside P prefill workers; TP=1: every P + D = G)."""
    found = []
    for prefill in range(1, devices):
        decode = (devices - prefill * prefill_tp) // decode_tp
        if decode < 1:
            break
        if devices - prefill * prefill_tp - decode * decode_tp < prefill_tp:  # else P + 1 fits beside them
            found.append((prefill, decode))
    return found
