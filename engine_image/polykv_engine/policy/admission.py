"""Admission math (pure): capacity projection, settle windows, measured drop, guarantee.

The question is "may one more session join this pool now without
pushing the mean experienced decode tps of active sessions under the floor?". Decode compute
is shared by every session on the engine, so the mean and its projection are engine-wide;
the settle window, measured drop and guaranteed minimum belong to the pool.

Arms, in order (the first that decides wins):
1. context (hard): ``expected_tokens`` that cannot fit a slot's context or the free cells;
2. guaranteed minimum: fewer attached sessions than ``guarantee_min_sessions`` → admit;
3. settling: the last admit has not been absorbed by the measurements yet → wait;
4. KV headroom: no room for one more session's private suffix → refuse;
5. tps floor: the projected mean (measured drop once known, else n/(n+1)) under the target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from polykv_api.models import AdmissionPolicy, AdmissionReason, Capacity
from polykv_engine.policy.tps import ActiveRates, active_rates

DROP_ALPHA = 0.3  # weight of the newest measured drop factor in its EWMA
IDLE_SAMPLE_FRESH_S = 30.0  # a settled mean older than this says nothing about now
DEFAULT_SESSION_TOKENS = 256  # private suffix assumed when nothing better is known

REASON_OK = "ok"
REASON_SETTLING = "measurement settling"
REASON_GUARANTEED = "guaranteed minimum"
REASON_FLOOR = "projected mean tps below floor"
REASON_FLOOR_IDLE = "projected mean tps below floor (idle estimate)"
REASON_KV = "kv headroom exhausted"
REASON_CONTEXT = "context headroom exhausted"

# The spec's human reason strings and the stable codes programs match on.
REASON_CODES: dict[str, AdmissionReason] = {
    REASON_OK: "ok",
    REASON_GUARANTEED: "guaranteed",
    REASON_SETTLING: "settling",
    REASON_FLOOR: "tps_floor",
    REASON_FLOOR_IDLE: "tps_floor",
    REASON_KV: "kv_headroom",
    REASON_CONTEXT: "context_headroom",
}


@dataclass(frozen=True, slots=True)
class SessionView:
    """One slot as admission sees it."""

    task_id: int | None
    decoding: bool
    warming: bool
    tps_ewma: float
    n_decoded: int
    in_pool: bool
    ctx_used: int
    private_tokens: int  # cells only this session holds


@dataclass(frozen=True, slots=True)
class EngineView:
    sessions: tuple[SessionView, ...]
    free_cells: int
    total_cells: int
    n_ctx_slot: int
    idle_slots: int
    pool_prefix_len: int

    @property
    def active(self) -> ActiveRates:
        return active_rates((s.decoding, s.warming, s.tps_ewma) for s in self.sessions)

    @property
    def mean_active(self) -> float:
        return self.active.mean

    @property
    def n_warming(self) -> int:
        return self.active.n_warming

    @property
    def n_pool_sessions(self) -> int:
        return sum(1 for s in self.sessions if s.in_pool)


@dataclass(slots=True)
class Settle:
    t_admit: float
    task_id: int
    mean_at_admit: float
    n_active_at_admit: int


@dataclass(slots=True)
class PoolAdmissionState:
    """What a pool remembers between admits.

    The measured drop is learned as a correction factor on the n/(n+1) model's drop
    (``drop_factor`` = measured drop ÷ the model's drop at that n), so one admit's lesson
    carries to the next at a different n: measured here, the first admit's absolute drop
    (1 → 2 sessions, ~30 tok/s) is many times the later ones' (3–6 tok/s), and an absolute
    EWMA seeded by it refused every further session. ``drop_per_admit_ewma`` reports the
    resulting forecast in tok/s for the next admit.
    """

    settle: Settle | None = None
    drop_factor: float | None = None
    last_settled_mean: float | None = None
    last_settled_ts: float = 0.0
    history: list[float] = field(default_factory=list)  # recent measured drops, newest last

    def record_admit(self, task_id: int, view: EngineView, now: float) -> None:
        self.settle = Settle(now, task_id, view.mean_active, view.active.n_active)

    def settle_remaining_ms(self, policy: AdmissionPolicy, now: float) -> float:
        if self.settle is None:
            return 0.0
        return max(0.0, policy.settle_max_ms - (now - self.settle.t_admit) * 1e3)

    def forecast_drop(self, mean: float, n: int) -> float | None:
        """The next admit's drop in tok/s at the current mean and n, once one was measured."""
        if self.drop_factor is None or n <= 0:
            return None
        return self.drop_factor * mean / (n + 1)

    def update(self, policy: AdmissionPolicy, view: EngineView, now: float) -> bool:
        """Close the settle window when the admitted session has decoded ``settle_tokens``
        or ``settle_max_ms`` passed (a turn shorter than settle_tokens waits for the timeout:
        closing early would measure the mean without the admitted session). While no window
        is open, a live mean refreshes the last settled mean, so the idle-gap estimate stays
        fresh on a busy pool. Returns True when a window closed."""
        s = self.settle
        mean_now = view.mean_active
        if s is None:
            if mean_now > 0 and view.n_warming == 0:
                self.last_settled_mean = mean_now
                self.last_settled_ts = now
            return False
        admitted = next((x for x in view.sessions if x.task_id == s.task_id), None)
        decoded_enough = admitted is not None and admitted.n_decoded >= policy.settle_tokens
        timed_out = (now - s.t_admit) * 1e3 >= policy.settle_max_ms
        if not (decoded_enough or timed_out):
            return False
        n0 = s.n_active_at_admit
        if n0 > 0 and mean_now > 0 and s.mean_at_admit > 0:
            drop = max(0.0, s.mean_at_admit - mean_now)
            factor = drop / (s.mean_at_admit / (n0 + 1))
            self.drop_factor = (
                factor
                if self.drop_factor is None
                else DROP_ALPHA * factor + (1 - DROP_ALPHA) * self.drop_factor
            )
            self.history = [*self.history[-15:], drop]
        if mean_now > 0:
            self.last_settled_mean = mean_now
            self.last_settled_ts = now
        self.settle = None
        return True


def compaction_pressure(view: EngineView) -> float:
    """0 while under half of the cells and of the fullest session's context are used, rising
    linearly to 1 at full: the orchestrator should compact before it reaches 1."""
    cells = 1.0 - view.free_cells / view.total_cells if view.total_cells else 0.0
    fullest = max((s.ctx_used for s in view.sessions), default=0)
    ctx = fullest / view.n_ctx_slot if view.n_ctx_slot else 0.0
    return min(1.0, max(0.0, (max(cells, ctx) - 0.5) / 0.5))


def session_cells(view: EngineView, expected_tokens: int | None) -> int:
    """Cells one more session is expected to need: its private suffix, not the shared prefix."""
    if expected_tokens is not None:
        return max(1, expected_tokens)
    private = [s.private_tokens for s in view.sessions if s.in_pool and s.private_tokens > 0]
    if private:
        return max(1, math.ceil(sum(private) / len(private)))
    return DEFAULT_SESSION_TOKENS


def capacity(
    policy: AdmissionPolicy | None,
    state: PoolAdmissionState,
    view: EngineView,
    now: float,
    expected_tokens: int | None = None,
    known_session: bool = False,
) -> Capacity:
    mean = view.mean_active
    n = view.active.n_active
    fresh = (
        state.last_settled_mean is not None and now - state.last_settled_ts < IDLE_SAMPLE_FRESH_S
    )
    if 0 < n < view.n_pool_sessions and fresh and state.last_settled_mean is not None:
        # Some of the pool's sessions are between turns: the live mean flatters the load they
        # bring back, so judge from the lower of it and the last settled mean, at the pool's n.
        mean = min(mean, state.last_settled_mean)
        n = view.n_pool_sessions
    model = mean * n / (n + 1) if n > 0 else None
    drop = state.forecast_drop(mean, n)
    measured = max(0.0, mean - drop) if drop is not None else None
    projected = measured if measured is not None else model
    idle_estimate = False
    if n == 0 and view.n_pool_sessions > 0 and fresh and state.last_settled_mean is not None:
        # Every session is between turns: no live rate, but the last settled mean is fresh,
        # so "nothing decoding" must not read as free capacity.
        idle_estimate = True
        last = state.last_settled_mean
        k = view.n_pool_sessions
        drop = state.forecast_drop(last, k)
        projected = max(0.0, last - drop) if drop is not None else last * k / (k + 1)
    per_session = session_cells(view, expected_tokens)
    kv_room = view.free_cells // per_session
    headroom = max(0, min(kv_room, view.idle_slots))
    kv_pct = 100.0 * view.free_cells / view.total_cells if view.total_cells else 0.0
    settling = policy is not None and state.settle is not None
    remaining = state.settle_remaining_ms(policy, now) if policy is not None else 0.0
    guaranteed = False

    def verdict() -> tuple[bool, str]:
        nonlocal guaranteed
        if expected_tokens is not None and (
            view.pool_prefix_len + expected_tokens > view.n_ctx_slot
            or expected_tokens > view.free_cells
        ):
            return False, REASON_CONTEXT
        if policy is not None and view.n_pool_sessions < policy.guarantee_min_sessions:
            guaranteed = True
            return True, REASON_GUARANTEED
        if known_session:
            return True, REASON_OK  # a continuation is never gated
        if settling:
            return False, REASON_SETTLING
        if kv_room < 1:
            return False, REASON_KV
        if (
            policy is not None
            and projected is not None
            and projected < policy.target_tps_per_session
        ):
            return False, REASON_FLOOR_IDLE if idle_estimate else REASON_FLOOR
        return True, REASON_OK

    ok, reason = verdict()
    return Capacity(
        can_admit=ok,
        reason=reason,
        reason_code=REASON_CODES[reason],
        projected_mean_tps_if_admitted=projected,
        projected_mean_tps_model=model,
        projected_mean_tps_measured=measured,
        projected_idle_estimate=idle_estimate,
        drop_per_admit_ewma=drop,
        headroom_sessions=headroom,
        kv_headroom_pct=kv_pct,
        settling=settling,
        settle_remaining_ms=remaining if settling else 0.0,
        n_warming=view.n_warming,
        n_active=n,
        mean_active_tps=mean,
        n_pool_sessions=view.n_pool_sessions,
        guaranteed=guaranteed,
        known_session=known_session,
        compaction_pressure=compaction_pressure(view),
    )


def retry_after_s(cap: Capacity, policy: AdmissionPolicy) -> int:
    """Whole seconds a refused client should wait (RFC 9110 Retry-After is an integer)."""
    if cap.settling:
        return max(1, math.ceil(cap.settle_remaining_ms / 1e3))
    return max(1, math.ceil(policy.settle_max_ms / 1e3))
