"""Per-request disaggregation decisions: prefill on a prefill worker (remote: the KV travels to the decode
worker) or on the decode worker itself (local: no prefill queue, no transfer; the prompt is computed
between that worker's decode steps).

`--disagg-policy` (ClusterConfig.disagg_policy) with the threshold T = `--local-prefill-tokens`:
- length: local when the prompt has fewer than T tokens (what conditional disaggregation did before).
- uncached (the default; llm-d's decider): local when fewer than T of the prompt's tokens are left after
  the decode worker's prefix-cache match (its cached leading blocks, item 3's match), so a chat turn whose
  history the decode worker holds is finished there whatever the length of that history.
- uncached_or_load (Dynamo's `isl_or_load` in spirit): as uncached, or when the prefill queue's estimated
  wait (queued prompt tokens on the least loaded prefill worker / the measured prefill throughput) exceeds
  the cost of the local prefill (uncached tokens / the measured local prefill throughput).

With T = 0 (the default) `length` and `uncached` send every prompt to a prefill worker, as before.
The match happens on the decode worker at expect(), so the coordinator sends it a bound instead of a
verdict: local_below_uncached_tokens(policy, load) (0: never); the worker prefills locally when fewer
uncached tokens than that are left (decode_worker/worker.py expect()). `decide` is the whole decision as one
pure function of a snapshot, which is what the two halves compute together.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cluster.backend import Timing
from cluster.workers.cluster_config import DISAGG_POLICIES

REMOTE, LOCAL = "remote", "local"
MIN_MEASURED_TOKENS = 32   # shorter prefills say little about throughput: not measured
EWMA_WEIGHT = 0.2          # the newest measurement's weight


@dataclass(frozen=True)
class DisaggPolicy:
    """The policy's name (one of DISAGG_POLICIES) and its threshold T in tokens (0: no threshold)."""

    name: str
    threshold_tokens: int = 0

    def __post_init__(self) -> None:
        if self.name not in DISAGG_POLICIES:
            raise ValueError(f"disagg_policy must be one of {DISAGG_POLICIES}, got {self.name!r}")
        if isinstance(self.threshold_tokens, bool) or not isinstance(self.threshold_tokens, int) \
                or self.threshold_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be an int >= 0, got {self.threshold_tokens!r}")


@dataclass(frozen=True)
class PrefillQueue:
    """What the load rule sees. queued_tokens: prompt tokens waiting on the least loaded alive prefill
    worker; the throughputs in tokens/s, None until measured (local: then taken as the prefill workers')."""

    queued_tokens: int = 0
    prefill_tokens_per_s: float | None = None
    local_tokens_per_s: float | None = None

    @property
    def wait_s(self) -> float:
        """The prefill queue's estimated wait; 0 until the prefill throughput is measured."""
        if not self.prefill_tokens_per_s:
            return 0.0
        return self.queued_tokens / self.prefill_tokens_per_s


@dataclass(frozen=True)
class DecisionSnapshot:
    """One request as the decision sees it: its prompt, the leading prompt tokens its decode worker holds
    in its prefix cache (a whole number of blocks), and the load."""

    prompt_tokens: int
    cached_tokens: int = 0
    load: PrefillQueue = PrefillQueue()

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def forced_local(policy: DisaggPolicy, prompt_tokens: int) -> bool:
    """Whether the request is local before any match: `length` with a prompt shorter than T."""
    return policy.name == "length" and prompt_tokens < policy.threshold_tokens


def local_below_uncached_tokens(policy: DisaggPolicy, load: PrefillQueue) -> int:
    """The bound the decode worker applies after its match: local when fewer uncached prompt tokens than
    this are left (0: never; `length` decides without the match, see forced_local)."""
    if policy.name == "length":
        return 0
    bound = policy.threshold_tokens
    if policy.name == "uncached_or_load" and load.wait_s > 0:
        local_rate = load.local_tokens_per_s or load.prefill_tokens_per_s
        bound = max(bound, math.ceil(load.wait_s * local_rate))   # uncached / local_rate < wait_s
    return bound


def decide(policy: DisaggPolicy, snapshot: DecisionSnapshot) -> str:
    """REMOTE or LOCAL for one request: forced_local, else uncached tokens against the bound."""
    if forced_local(policy, snapshot.prompt_tokens):
        return LOCAL
    bound = local_below_uncached_tokens(policy, snapshot.load)
    return LOCAL if snapshot.uncached_tokens < bound else REMOTE


class ThroughputMeter:
    """Prefill throughput in tokens/s: an exponentially weighted mean of measured prefills (tokens
    computed / seconds from first scheduled to first token) of at least MIN_MEASURED_TOKENS tokens.
    A prefill packed with others reads slower than the worker runs, so the wait it predicts errs long."""

    def __init__(self) -> None:
        self.tokens_per_s: float | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds
        previous = self.tokens_per_s
        self.tokens_per_s = rate if previous is None else (1 - EWMA_WEIGHT) * previous + EWMA_WEIGHT * rate


class PrefillPlacer:
    """The coordinator's half of the decision: the policy, and the prefill throughputs it measures (remote:
    from each PrefillReport; local: from each locally prefilled request's timing). Used from one loop."""

    def __init__(self, policy: DisaggPolicy) -> None:
        self.policy = policy
        self._remote, self._local = ThroughputMeter(), ThroughputMeter()

    def forced_local(self, prompt_tokens: int) -> bool:
        return forced_local(self.policy, prompt_tokens)

    def local_bound(self, queued_prefill_tokens: int) -> int:
        """local_below_uncached_tokens for the decode worker, with the prefill queue as it is now."""
        load = PrefillQueue(queued_prefill_tokens, self._remote.tokens_per_s, self._local.tokens_per_s)
        return local_below_uncached_tokens(self.policy, load)

    def observe_remote(self, computed_tokens: int, prefill_ms: float) -> None:
        self._remote.observe(computed_tokens, prefill_ms / 1e3)

    def observe_local(self, uncached_tokens: int, prefill_ms: float) -> None:
        self._local.observe(uncached_tokens, prefill_ms / 1e3)

    def decided(self, timing: Timing, prefilled_locally: bool, cached_tokens: int, prompt_tokens: int) -> Timing:
        """A request's final Timing with its decision (prefill_location) and the prompt tokens its decode
        worker held (decode_cached_tokens); a local prefill's speed is measured from it."""
        if prefilled_locally:
            self.observe_local(prompt_tokens - cached_tokens, timing.prefill_ms)
        return dataclasses.replace(timing, prefill_location=LOCAL if prefilled_locally else REMOTE,
                                   decode_cached_tokens=cached_tokens)
