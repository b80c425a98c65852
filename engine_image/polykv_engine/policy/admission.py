"""Admission math (pure): capacity projection, settle windows, guarantee.

The question is "may one more session join this pool now without pushing the mean
experienced decode tps of active sessions under the floor?". Decode compute is shared by
every session on the engine, so the mean and its projection are engine-wide; the settle
window and guaranteed minimum belong to the pool.

The projection is pause-aware. Agents spend part of each cycle in tool calls, and while some
are paused the others decode faster: the live mean flatters the load the paused ones bring
back (the error that let earlier gates over-admit). So admission counts the *returning*
sessions, R: those decoding plus those whose turn ended within ``RETURN_WINDOW_S``, and
projects the rate everyone gets when all R + 1 decode together, scaling the rate measured now
(at b sessions decoding) by the engine's measured step-time curve: rate × t(b) / t(R + 1)
(``policy.step_time``). Until the curve has two measured sizes, the model assumes a flat
aggregate (rate × b / (R + 1)), the cautious guess.

The rate read at one instant is noisy (each session's EWMA spans ~2 s, and right after a tool
call pause it still carries the faster seconds when fewer sessions decoded), and a gate that
admits whenever one noisy reading clears the floor admits on the high readings: in the spawn
ramp every over-admit came at a reading 15-20% above the typical rate at that count. So the
projection is also made from every reading of the last ``RATE_WINDOW_S``, each scaled from
its own b to R + 1 by the curve, and their median; the lower of that and the projection from
the live reading decides (a real drop shows at once, a lucky moment does not count). Both are
capped by the rate the engine's own step times give R + 1 sessions (``ceiling``): the
readings after a pause were earned at fewer sessions than the live count says, while each
step is timed at the batch it really had. The cap reads the *cycle* curve (token-to-token
time, prompt chunks included: ``policy.step_time``), since every returning agent brings
prompt work back with it, and a curve of decode-only steps priced the fifth agent of the
spawn ramp at a third of what it cost.

Arms, in order (the first that decides wins):
1. context (hard): ``expected_tokens`` that cannot fit a slot's context or the free cells;
2. guaranteed minimum: fewer attached sessions than ``guarantee_min_sessions`` → admit;
3. settling: the last admit has not been absorbed by the measurements yet → wait;
4. prompt work: the prompts the engine has promised to compute (``policy.prefill`` paces
   them beside the decoding sessions) would hold the sessions under the floor while they
   run → wait, as for settling (the dip passes when the prompts are in);
5. KV headroom: no room for one more session's private suffix → refuse;
6. tps floor: the projected mean under the target.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from polykv_api.models import AdmissionPolicy, AdmissionReason, Capacity
from polykv_engine.policy.prefill import PrefillModel
from polykv_engine.policy.step_time import CeilingCurve, StepCurve
from polykv_engine.policy.tps import ActiveRates, active_rates

IDLE_SAMPLE_FRESH_S = 30.0  # a measured mean older than this says nothing about now
RETURN_WINDOW_S = 10.0  # a session whose turn ended this recently is in a tool call
RATE_WINDOW_S = 10.0  # readings of the mean rate the projection takes the median of
READING_EVERY_S = 0.1  # at most one reading per this interval (the gate ticks faster)
MIN_WINDOW_READINGS = 5  # fewer readings than this: the live one alone decides
DEFAULT_SESSION_TOKENS = 256  # private suffix assumed when nothing better is known

REASON_OK = "ok"
REASON_SETTLING = "measurement settling"
REASON_GUARANTEED = "guaranteed minimum"
REASON_FLOOR = "projected mean tps below floor"
REASON_FLOOR_IDLE = "projected mean tps below floor (idle estimate)"
REASON_KV = "kv headroom exhausted"
REASON_CONTEXT = "context headroom exhausted"
REASON_PREFILL = "prompt work in progress would dip under the floor"

# The spec's human reason strings and the stable codes programs match on.
REASON_CODES: dict[str, AdmissionReason] = {
    REASON_OK: "ok",
    REASON_GUARANTEED: "guaranteed",
    REASON_SETTLING: "settling",
    REASON_FLOOR: "tps_floor",
    REASON_FLOOR_IDLE: "tps_floor",
    REASON_KV: "kv_headroom",
    REASON_CONTEXT: "context_headroom",
    REASON_PREFILL: "prefill",
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
    returning: bool = False  # running a turn, or between turns (its last ended recently)
    floor_tps: float | None = None  # the floor of the pool it is attached to, if any


@dataclass(frozen=True, slots=True)
class EngineView:
    sessions: tuple[SessionView, ...]
    free_cells: int
    total_cells: int
    n_ctx_slot: int
    idle_slots: int
    pool_prefix_len: int
    step_curve: StepCurve = field(default_factory=StepCurve)
    cycle_curve: StepCurve = field(default_factory=StepCurve)
    pause_aware: bool = True  # count returning sessions, not only those decoding now
    ceiling_curve: CeilingCurve = "cycle"
    prefill_pending: int = 0  # prompt tokens the engine has promised to compute
    prefill: PrefillModel = field(default_factory=PrefillModel)
    n_batch: int = 0

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
    def n_decoding(self) -> int:
        return sum(1 for s in self.sessions if s.decoding)

    @property
    def n_back_soon(self) -> int:
        """Sessions decoding now or between turns (engine-wide)."""
        return sum(1 for s in self.sessions if s.returning or s.decoding)

    @property
    def n_returning(self) -> int:
        """The sessions to plan for: those back soon, or (not pause-aware) those decoding."""
        return self.n_back_soon if self.pause_aware else self.n_decoding

    @property
    def n_pool_sessions(self) -> int:
        return sum(1 for s in self.sessions if s.in_pool)


@dataclass(slots=True)
class Settle:
    t_admit: float
    task_id: int


@dataclass(slots=True)
class LoadMemory:
    """Engine-wide readings of the measured mean: the last one, so that a moment when
    everyone is between turns does not read as free capacity, and those of the last
    ``RATE_WINDOW_S`` with the number of sessions each was measured at, for the projection's
    windowed median."""

    mean: float = 0.0
    n_decoding: int = 0
    ts: float = -math.inf
    readings: deque[tuple[float, float, int]] = field(default_factory=deque)  # (ts, mean, b)
    _typical: dict[tuple[int, tuple[tuple[int, float], ...]], float | None] = field(
        default_factory=dict
    )

    def observe(self, view: EngineView, now: float) -> None:
        live = view.active
        if live.n_active > 0 and live.n_warming == 0:
            self.mean, self.n_decoding, self.ts = live.mean, live.n_active, now
            if not self.readings or now - self.readings[-1][0] >= READING_EVERY_S:
                self.readings.append((now, live.mean, live.n_active))
                self._typical.clear()
        self._forget_before(now - RATE_WINDOW_S)

    def _forget_before(self, t: float) -> None:
        while self.readings and self.readings[0][0] < t:
            self.readings.popleft()
            self._typical.clear()

    def fresh(self, now: float) -> bool:
        return self.n_decoding > 0 and now - self.ts < IDLE_SAMPLE_FRESH_S

    def typical(self, curve: StepCurve, b_to: int, now: float) -> float | None:
        """The median of the window's readings, each scaled to ``b_to`` sessions; computed
        once per change of the window (every pool's status in a listing asks)."""
        self._forget_before(now - RATE_WINDOW_S)
        key = (b_to, curve.points)
        if key not in self._typical:
            factors = {b: curve.scale(1.0, b, b_to) for b in {b for _, _, b in self.readings}}
            scaled = [m * f for _, m, b in self.readings if (f := factors[b]) is not None]
            self._typical[key] = (
                statistics.median(scaled) if len(scaled) >= MIN_WINDOW_READINGS else None
            )
        return self._typical[key]


@dataclass(slots=True)
class PoolAdmissionState:
    """What a pool remembers between admits: the open settle window, if any, and the
    sessions admitted but not on a slot yet (they count toward the guaranteed minimum, or
    two spawns arriving together would both be "the first")."""

    settle: Settle | None = None
    seating: set[int] = field(default_factory=set)

    def record_admit(self, task_id: int, now: float) -> None:
        self.settle = Settle(now, task_id)
        self.seating.add(task_id)

    def forget(self, task_id: int) -> None:
        """The request ended (answered, failed or cancelled): it is no longer seating."""
        self.seating.discard(task_id)

    def n_seating(self, view: EngineView) -> int:
        """Admitted and not on a slot yet (those on one, the view counts already)."""
        seated = {s.task_id for s in view.sessions if s.in_pool}
        return sum(1 for t in self.seating if t not in seated)

    def settle_remaining_ms(self, policy: AdmissionPolicy, now: float) -> float:
        if self.settle is None:
            return 0.0
        return max(0.0, policy.settle_max_ms - (now - self.settle.t_admit) * 1e3)

    def update(self, policy: AdmissionPolicy, view: EngineView, now: float) -> bool:
        """Close the settle window when the admitted session has decoded ``settle_tokens``
        or ``settle_max_ms`` passed (a turn shorter than settle_tokens waits for the timeout:
        closing early would measure the mean without the admitted session). Returns True
        when a window closed."""
        s = self.settle
        if s is None:
            return False
        admitted = next((x for x in view.sessions if x.task_id == s.task_id), None)
        decoded_enough = admitted is not None and admitted.n_decoded >= policy.settle_tokens
        timed_out = (now - s.t_admit) * 1e3 >= policy.settle_max_ms
        if not (decoded_enough or timed_out):
            return False
        self.settle = None
        return True


@dataclass(frozen=True, slots=True)
class Projection:
    model: float | None  # flat aggregate: rate × b / (R + 1)
    measured: float | None  # the step-time curve: rate × t(b) / t(R + 1), or the window's
    at_returning: float | None  # the same, for the R sessions alone (no admit)
    idle_estimate: bool

    @property
    def if_admitted(self) -> float | None:
        return self.measured if self.measured is not None else self.model


def project(view: EngineView, memory: LoadMemory, now: float) -> Projection:
    """The mean decode rate when every returning session and one more decode together."""
    live = view.active
    idle_estimate = False
    if live.n_active > 0:
        # The rate was measured before any warming session joined (its EWMA spans ~2 s):
        # it belongs to the measured sessions' count; the warming ones are in R.
        mean, b = live.mean, live.n_active
    elif view.n_back_soon > 0 and memory.fresh(now):
        # Everyone is between turns (or still warming): no live rate, but a recent one, and
        # at least the sessions it was measured with come back.
        mean, b, idle_estimate = memory.mean, memory.n_decoding, True
    else:
        return Projection(None, None, None, False)
    r = max(view.n_returning, b)
    curve = view.step_curve
    if not curve.measured:
        return Projection(mean * b / (r + 1), None, mean * b / r, idle_estimate)

    def at(n: int) -> float | None:
        now_rate = curve.scale(mean, b, n)
        if now_rate is None:
            return None
        typical = memory.typical(curve, n, now)
        return min(x for x in (now_rate, typical, ceiling(view, n)) if x is not None)

    return Projection(mean * b / (r + 1), at(r + 1), at(r), idle_estimate)


def ceiling(view: EngineView, n: int) -> float | None:
    """The most a session can get with n decoding together: one token per step, 1 / t(n).

    Scaling a reading by t(b) / t(n) assumes it was earned at b sessions, but a session's
    EWMA spans ~2 s, and while some agents sat in tool calls it was earned at fewer: right
    after pauses it overstated by 26-46% in the spawn ramp. The ceiling reads no session
    rate at all, only step times, each measured at the batch that step had. The cycle curve
    (the default) holds the prompt work the returning agents bring; until it has a point,
    the decode-only curve stands in. t(n) is an EWMA of recent steps, so when contexts have
    shrunk since, it can read below the rate sessions get; it only ever lowers a projection,
    the cautious side."""
    if view.ceiling_curve == "none":
        return None
    curve = view.step_curve
    if view.ceiling_curve == "cycle" and view.cycle_curve.points:
        curve = view.cycle_curve
    t = curve.time_at(n)
    return 1.0 / t if t else None


def prefill_dip(view: EngineView, floor_tps: float | None) -> float | None:
    """The decode rate a session gets while the promised prompts are computed beside every
    returning session (paced at the tightest floor among them and ``floor_tps``, the pool's
    own, whose next session joins them); None when nothing is promised or the decode-only
    step time at that size is not measured yet."""
    if view.prefill_pending <= 0:
        return None
    b = max(view.n_returning, 1)
    t_dec = view.step_curve.time_at(b)
    if t_dec is None:
        return None
    floors = [s.floor_tps for s in view.sessions if s.decoding or s.returning]
    period = view.prefill.period_s([*floors, floor_tps])
    step = view.prefill.step_s(period, t_dec, view.prefill_pending, max(1, view.n_batch - b))
    return 1.0 / step if step > 0 else None


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
    memory: LoadMemory | None = None,
) -> Capacity:
    proj = project(view, memory or LoadMemory(), now)
    projected = proj.if_admitted
    drop = (
        max(0.0, proj.at_returning - projected)
        if proj.at_returning is not None and projected is not None
        else None
    )
    per_session = session_cells(view, expected_tokens)
    kv_room = view.free_cells // per_session
    headroom = max(0, min(kv_room, view.idle_slots))
    kv_pct = 100.0 * view.free_cells / view.total_cells if view.total_cells else 0.0
    settling = policy is not None and state.settle is not None
    dip = prefill_dip(view, policy.target_tps_per_session if policy is not None else None)
    remaining = state.settle_remaining_ms(policy, now) if policy is not None else 0.0
    guaranteed = False

    def verdict() -> tuple[bool, str]:
        nonlocal guaranteed
        if expected_tokens is not None and (
            view.pool_prefix_len + expected_tokens > view.n_ctx_slot
            or expected_tokens > view.free_cells
        ):
            return False, REASON_CONTEXT
        if (
            policy is not None
            and view.n_pool_sessions + state.n_seating(view) < policy.guarantee_min_sessions
        ):
            guaranteed = True
            return True, REASON_GUARANTEED
        if known_session:
            return True, REASON_OK  # a continuation is never gated
        if settling:
            return False, REASON_SETTLING
        if policy is not None and dip is not None and dip < policy.target_tps_per_session:
            return False, REASON_PREFILL
        if kv_room < 1:
            return False, REASON_KV
        if (
            policy is not None
            and projected is not None
            and projected < policy.target_tps_per_session
        ):
            return False, REASON_FLOOR_IDLE if proj.idle_estimate else REASON_FLOOR
        return True, REASON_OK

    ok, reason = verdict()
    return Capacity(
        can_admit=ok,
        reason=reason,
        reason_code=REASON_CODES[reason],
        projected_mean_tps_if_admitted=projected,
        projected_mean_tps_model=proj.model,
        projected_mean_tps_measured=proj.measured,
        projected_idle_estimate=proj.idle_estimate,
        drop_per_admit_ewma=drop,
        headroom_sessions=headroom,
        kv_headroom_pct=kv_pct,
        settling=settling,
        settle_remaining_ms=remaining if settling else 0.0,
        n_warming=view.n_warming,
        n_active=view.active.n_active,
        mean_active_tps=view.mean_active,
        n_pool_sessions=view.n_pool_sessions,
        guaranteed=guaranteed,
        known_session=known_session,
        compaction_pressure=compaction_pressure(view),
        prefill_pending_tokens=view.prefill_pending,
        projected_prefill_tps=dip,
    )


def retry_after_s(cap: Capacity, policy: AdmissionPolicy) -> int:
    """Whole seconds a refused client should wait (RFC 9110 Retry-After is an integer)."""
    if cap.settling:
        return max(1, math.ceil(cap.settle_remaining_ms / 1e3))
    return max(1, math.ceil(policy.settle_max_ms / 1e3))
