"""The autoscaler's decision: a pure function of a frozen snapshot of the coordinator's own numbers.

    decision, state = decide(snapshot, policy, state)     # Decision(role, +1 | -1, reason) or None

Signals per role (each a value against a threshold; its ratio value / threshold):
- prefill (and replicas): TTFT p90 against ttft_slo_ms, the queue-time p90 against half of it, and the
  prompt tokens waiting for their first token per serving worker against prefill_queue_tokens;
- decode (and replicas): ITL p90 against itl_slo_ms, batch occupancy (running requests / what the serving
  workers hold at most) against decode_occupancy, and used KV blocks against 1 - free_blocks.
A role is *pressed* when any ratio passes 1, *idle* when, counted with one worker fewer (the per-worker
loads scaled by n / (n - 1)), every ratio stays below low_ratio (missing latencies count as 0).

Hysteresis: a role must be pressed up_ticks ticks in a row to get a worker, idle down_ticks ticks in a row
to lose one, and the gap between the up and down thresholds is low_ratio. Cool-down: after a change a role
waits cooldown_s, and no role changes while one of its workers starts or drains. At most one change per
tick: the most pressed role gets a worker; otherwise an idle role loses one; never past the bounds.
The loop that takes snapshots and applies decisions is cluster/coordinator/autoscale_loop.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DECODE_SIDE = ("decode", "replica")
PREFILL_SIDE = ("prefill", "replica")


@dataclass(frozen=True)
class AutoscalePolicy:
    """interval_s: between two decisions. window_s: the latency percentiles' window (min_samples at least,
    else no latency signal). The thresholds and hysteresis: see the module docstring."""

    interval_s: float = 5.0
    cooldown_s: float = 30.0
    window_s: float = 30.0
    min_samples: int = 5
    ttft_slo_ms: float = 1000.0
    itl_slo_ms: float = 100.0
    prefill_queue_tokens: int = 8192
    decode_occupancy: float = 0.8
    free_blocks: float = 0.1
    low_ratio: float = 0.5
    up_ticks: int = 2
    down_ticks: int = 3

    def __post_init__(self) -> None:
        positive = {"interval_s": self.interval_s, "window_s": self.window_s, "ttft_slo_ms": self.ttft_slo_ms,
                    "itl_slo_ms": self.itl_slo_ms, "prefill_queue_tokens": self.prefill_queue_tokens}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.cooldown_s < 0 or self.min_samples < 1 or self.up_ticks < 1 or self.down_ticks < 1:
            raise ValueError("cooldown_s must be >= 0; min_samples, up_ticks and down_ticks >= 1")
        for name, value in (("decode_occupancy", self.decode_occupancy), ("free_blocks", self.free_blocks),
                            ("low_ratio", self.low_ratio)):
            if not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value}")


@dataclass(frozen=True)
class RoleSnapshot:
    """One role's workers and load. changing: its workers starting or draining. queued_tokens: prompt
    tokens routed to its serving workers without a first token yet; running: requests its serving decode
    workers hold, capacity: the most they hold; free / total KV blocks of its serving decode workers."""

    role: str
    serving: int
    changing: int
    minimum: int
    maximum: int | None
    queued_tokens: int = 0
    running: int = 0
    capacity: int = 0
    free_blocks: int = 0
    total_blocks: int = 0


@dataclass(frozen=True)
class ScaleSnapshot:
    """at: time.monotonic() of the snapshot; the latencies: p90s in ms over the window (None: too few)."""

    at: float
    roles: tuple[RoleSnapshot, ...]
    ttft_p90_ms: float | None = None
    itl_p90_ms: float | None = None
    queue_p90_ms: float | None = None


@dataclass(frozen=True)
class Signal:
    name: str
    value: float
    threshold: float

    @property
    def ratio(self) -> float:
        return self.value / self.threshold

    def __str__(self) -> str:
        return f"{self.name} {self.value:.3g} (threshold {self.threshold:.3g})"


@dataclass(frozen=True)
class RoleStreak:
    """Consecutive ticks pressed / idle, and when the role last changed (monotonic seconds)."""

    pressed: int = 0
    idle: int = 0
    last_change: float = -math.inf


@dataclass(frozen=True)
class AutoscaleState:
    streaks: tuple[tuple[str, RoleStreak], ...] = ()

    def of(self, role: str) -> RoleStreak:
        return dict(self.streaks).get(role, RoleStreak())

    def with_streak(self, role: str, streak: RoleStreak) -> AutoscaleState:
        return AutoscaleState(tuple((r, s) for r, s in self.streaks if r != role) + ((role, streak),))


@dataclass(frozen=True)
class Decision:
    role: str
    delta: int
    reason: str


def role_signals(role: RoleSnapshot, snapshot: ScaleSnapshot, policy: AutoscalePolicy,
                 workers: int | None = None) -> list[Signal]:
    """The role's signals with its load spread over `workers` (default: its serving workers)."""
    workers = role.serving if workers is None else workers
    if workers <= 0:
        return [Signal("serving workers", math.inf, 1.0)]
    share = role.serving / workers  # per-worker loads grow by this when one worker fewer carries them
    signals = []
    if role.role in PREFILL_SIDE:
        signals += [Signal("TTFT p90 ms", snapshot.ttft_p90_ms or 0.0, policy.ttft_slo_ms),
                    Signal("queue p90 ms", snapshot.queue_p90_ms or 0.0, policy.ttft_slo_ms / 2),
                    Signal("queued prompt tokens per worker", role.queued_tokens / workers,
                           policy.prefill_queue_tokens)]
    if role.role in DECODE_SIDE:
        occupancy = role.running / role.capacity * share if role.capacity else 0.0
        used = (1 - role.free_blocks / role.total_blocks) * share if role.total_blocks else 0.0
        signals += [Signal("ITL p90 ms", snapshot.itl_p90_ms or 0.0, policy.itl_slo_ms),
                    Signal("batch occupancy", occupancy, policy.decode_occupancy),
                    Signal("used KV blocks", used, 1 - policy.free_blocks)]
    return signals


def decide(snapshot: ScaleSnapshot, policy: AutoscalePolicy,
           state: AutoscaleState) -> tuple[Decision | None, AutoscaleState]:
    """At most one change for this tick (see the module docstring) and the state for the next tick."""
    ups, downs = [], []
    for role in snapshot.roles:
        pressed = [s for s in role_signals(role, snapshot, policy) if s.ratio > 1]
        after_drain = role_signals(role, snapshot, policy, role.serving - 1) if role.serving > 1 else None
        idle = not pressed and after_drain is not None and all(s.ratio < policy.low_ratio for s in after_drain)
        streak = state.of(role.role)
        streak = RoleStreak(streak.pressed + 1 if pressed else 0, streak.idle + 1 if idle else 0, streak.last_change)
        state = state.with_streak(role.role, streak)
        if role.changing or snapshot.at - streak.last_change < policy.cooldown_s:
            continue
        if pressed and streak.pressed >= policy.up_ticks and (role.maximum is None or role.serving < role.maximum):
            reason = f"pressed for {streak.pressed} ticks: " + ", ".join(map(str, pressed))
            ups.append((max(s.ratio for s in pressed), Decision(role.role, +1, reason)))
        elif idle and streak.idle >= policy.down_ticks and role.serving > role.minimum:
            reason = (f"idle for {streak.idle} ticks; with one worker fewer every signal stays below "
                      f"{policy.low_ratio:g} x its threshold: " + ", ".join(map(str, after_drain)))
            downs.append((max(s.ratio for s in after_drain), Decision(role.role, -1, reason)))
    chosen = max(ups, key=lambda up: up[0])[1] if ups else min(downs, key=lambda d: d[0])[1] if downs else None
    if chosen is not None:
        state = state.with_streak(chosen.role, RoleStreak(last_change=snapshot.at))
    return chosen, state
