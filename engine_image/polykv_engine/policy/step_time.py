"""How long one decode step takes with b sessions decoding together (pure).

Every decoding session gets one token per step, so a session's decode rate with b sessions
in the batch is about 1 / t(b). The engine records the time of each step that decoded only
(one token for each of b sessions, no prompt or pool chunk); admission then scales the rate
sessions experience now, at b_now, to the b an admit would bring: rate × t(b_now) / t(b).
Measured engine-wide, because every pool's sessions share the same compute.

Between measured sizes, and beyond the largest, t(b) follows a least-squares line through
the measured points (a step's cost is close to affine in b on CPUs and GPUs alike), never
below the time measured at a smaller size. With a single measured size the curve assumes
the aggregate rate stays flat (t proportional to b), the cautious guess.

A second curve, the *cycle* curve, times every step that had sessions decoding, from its
start to the next step's start, keyed by the sessions in the batch (decoding, or prefilling
their turn's prompt): prompt chunks, sampling, streaming and the loop are all in it, so
1 / cycle(n) is the rate a decoding session really gets while n sessions run their turns.
It is what caps admission's projection: the decode-only curve leaves out the prompt work
each agent brings back with every turn (its tool's answer), and in the spawn ramp that work
made the fifth agent cost three times what the decode-only curve said. Keyed by decoding
sessions only (tried first), a long prompt step landed on whatever few sessions happened to
be decoding, read 60-90 ms at two and three where a token took 30-40, and the cap refused a
second agent. Its EWMA spans more steps, since only some steps carry a prompt chunk and the
mean over the mix is wanted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

STEP_ALPHA = 0.05  # weight of one step in its size's EWMA (~20 steps of memory)
MIN_STEPS = 16  # steps at a size before that size counts as measured
CYCLE_ALPHA = 0.01  # ~100 steps of memory: several prompt-carrying steps in the mean
CYCLE_MIN_STEPS = 32
# A cycle size not seen for this long is dropped: the mix of prompt work it was measured
# under may be gone, and a gate that keeps the load below that size would never visit it
# again to correct a high reading (it would refuse forever on one bad minute).
CYCLE_FRESH_S = 30.0

# Which curve caps admission's projection: "cycle" (shipped), "step" (decode-only steps, the
# earlier cap) or "none"; the other two are kept for side-by-side measurement.
CeilingCurve = Literal["cycle", "step", "none"]
CEILING_CURVES: tuple[str, ...] = get_args(CeilingCurve)


@dataclass(frozen=True, slots=True)
class StepCurve:
    """Measured (b, seconds per step) points, b ascending; immutable, shared by threads."""

    points: tuple[tuple[int, float], ...] = ()

    @property
    def measured(self) -> bool:
        """Two sizes measured: the curve's shape is known, not assumed."""
        return len(self.points) >= 2

    def time_at(self, b: int) -> float | None:
        if not self.points or b <= 0:
            return None
        exact = dict(self.points)
        if b in exact:
            return exact[b]
        if len(self.points) == 1:
            b0, t0 = self.points[0]
            return t0 * b / b0
        slope, intercept = _fit(self.points)
        below = [t for size, t in self.points if size < b]
        b_min, t_min = self.points[0]
        # Fewer sessions than any measured size: no faster than the smallest size's
        # aggregate rate allows (the cautious side, as with one point).
        floor = max(below) if below else t_min * b / b_min
        return max(intercept + slope * b, floor)

    def scale(self, rate: float, b_from: int, b_to: int) -> float | None:
        """A per-session rate seen at ``b_from`` sessions, projected to ``b_to``."""
        t_from, t_to = self.time_at(b_from), self.time_at(b_to)
        if t_from is None or t_to is None or t_to <= 0:
            return None
        return rate * t_from / t_to


def _fit(points: tuple[tuple[int, float], ...]) -> tuple[float, float]:
    """Least-squares line t = intercept + slope × b, slope never negative."""
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var = sum((b - mean_b) ** 2 for b, _ in points)
    cov = sum((b - mean_b) * (t - mean_t) for b, t in points)
    slope = max(0.0, cov / var) if var > 0 else 0.0
    return slope, mean_t - slope * mean_b


@dataclass(slots=True)
class StepTimer:
    """The engine thread's recorder; ``curve()`` is what it publishes."""

    alpha: float = STEP_ALPHA
    min_steps: int = MIN_STEPS
    fresh_s: float | None = None  # sizes not recorded for this long leave the curve
    _ewma: dict[int, float] = field(default_factory=dict)
    _count: dict[int, int] = field(default_factory=dict)
    _seen: dict[int, float] = field(default_factory=dict)

    def record(self, b: int, seconds: float, now: float = 0.0) -> None:
        if b <= 0 or seconds <= 0:
            return
        if self._stale(b, now):  # start the size over: its old mix says nothing now
            self._ewma.pop(b, None)
            self._count.pop(b, None)
        self._seen[b] = now
        n = self._count.get(b, 0)
        old = self._ewma.get(b)
        # The first steps at a size average plainly, so one slow first step cannot linger.
        weight = max(self.alpha, 1.0 / (n + 1))
        self._ewma[b] = seconds if old is None else old + weight * (seconds - old)
        self._count[b] = n + 1

    def curve(self, now: float = 0.0) -> StepCurve:
        return StepCurve(
            tuple(
                (b, t)
                for b, t in sorted(self._ewma.items())
                if self._count.get(b, 0) >= self.min_steps and not self._stale(b, now)
            )
        )

    def _stale(self, b: int, now: float) -> bool:
        seen = self._seen.get(b)
        return self.fresh_s is not None and seen is not None and now - seen > self.fresh_s
