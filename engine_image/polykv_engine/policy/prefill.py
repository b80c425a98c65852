"""Prompt work paced so that sessions already decoding keep their floor (pure: callers pass
step times; no clock of its own).

Every decoding session gets one token per step, so a step that carries a whole prompt
freezes all of them for the whole prefill: four sessions at ~20 ms a token got none for
6 s while a 1,900-token prompt went through in one step. While sessions decode, a step
therefore carries at most a budget of prompt tokens (new prompts and pool builds together),
sized so that a decoding session's wait for its next token, the step and the engine loop's
time after it, lasts about ``AIM`` × the tightest floor period of the sessions decoding
(a 5 tok/s floor: 200 ms), leaving room for noise above their floor's rate. Every such
step also carries each decoding session's token, so between any two prompt chunks every
decoding session gets a token. The loop's time is measured, not guessed (under a
millisecond on an idle machine; a busy one may take more). Aiming closer to the period
buys the newcomer little: each step carries the decoding rows whatever its chunk, but deep
in a long prompt a token costs so much that the chunk, not the steps, sets the time (at
0.95, 8 sessions and 8,000 tokens: first token 1-5% sooner, the sessions' rate 5.8 -> 5.3
tok/s under a 5 tok/s floor). Where the decoding sessions' own step already takes most of
the period (the engine is over its floor, or the machine is busy), the prompt still gets as
much time per step as their decode does: their gap at most doubles while the prompt goes
in, rather than the prompt starving (on a machine loaded to 30x its usual step time, a
starved 2,000-token prompt took ten minutes).
A chunk is never smaller than ``MIN_CHUNK`` tokens (smaller ones cost more per token),
unless even that would stretch the wait past ``STRETCH`` floor periods: deep in a long
prompt every token attends to thousands of cells (8,000 tokens of SmolLM2 on 2 cores:
~20 ms a token late in the prompt), and 16 of them held four sessions 2.4 periods; then down
to ``FEWEST_ROWS``.
``--polykv-prefill-budget N`` fixes the budget instead (vLLM's chunked-prefill token
budget); with no floor among the decoding sessions and no fixed budget a step takes as much
prompt as the batch holds, as before.

The step-time model: t(k) = t_dec(b) + k × c, where t_dec(b) is the engine's measured time
of a decode-only step with b sessions (``policy.step_time``) and c the cost of one prompt
token in a mixed step, learned from every step that carried prompt tokens. c grows as the
prompt goes on (each token attends to all before it); the EWMA follows it within a few steps.
The loop's time between a paced step's end and the next step's start (streaming the tokens,
taking requests) is learned the same way from paced steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

AIM = 0.85  # a paced step and the loop after it aim at this share of the floor period
MIN_CHUNK = 16  # the smallest prompt chunk worth a step
STRETCH = 1.2  # ... unless it would stretch step and loop past this many floor periods
FEWEST_ROWS = 8  # ... and never fewer: at 4 rows a prompt token cost twice what it did at 16
FIRST_CHUNK = 32  # the first chunk, before any prompt step was timed
COST_ALPHA = 0.5  # weight of the last prompt step in the per-token cost
LOOP_ALPHA = 0.3  # weight of the last paced step's loop time in its estimate


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """What the pacer knows, published with the snapshot so admission can price the prompt
    work the engine has promised."""

    fixed_budget: int = 0  # --polykv-prefill-budget; 0: from the floor
    default_floor_tps: float = 0.0  # --polykv-prefill-floor-tps: for sessions without one
    token_s: float | None = None  # learned seconds per prompt token in a mixed step
    loop_s: float = 0.0  # learned seconds from a paced step's end to the next step's start

    def period_s(self, floors: Iterable[float | None]) -> float | None:
        """The tightest floor period among sessions with these floors (None: a session
        without a pool floor has the default), or None when none has a floor."""
        tightest = max((f or self.default_floor_tps for f in floors), default=0.0)
        return 1.0 / tightest if tightest > 0 else None

    def budget(self, period_s: float | None, t_dec: float | None, capacity: int) -> int:
        """Prompt tokens a step may carry beside ``b`` decoding sessions whose decode-only
        step takes ``t_dec``; ``period_s``: the tightest floor period among them (None: no
        floor)."""
        if self.fixed_budget > 0:
            return min(self.fixed_budget, capacity)
        if period_s is None:
            return capacity
        if self.token_s is None:
            return min(FIRST_CHUNK, capacity)
        t_dec = t_dec or 0.0
        room = max(AIM * period_s - self.loop_s - t_dec, t_dec)
        fit = int((STRETCH * period_s - self.loop_s - t_dec) / self.token_s)
        smallest = max(FEWEST_ROWS, min(MIN_CHUNK, fit))
        return min(capacity, max(smallest, int(room / self.token_s)))

    def step_s(self, period_s: float | None, t_dec: float, pending: int, capacity: int) -> float:
        """The time between two tokens of sessions whose decode-only step takes ``t_dec``
        while ``pending`` prompt tokens are paced beside them: the step and the loop after it."""
        k = min(pending, self.budget(period_s, t_dec, capacity))
        return t_dec + k * (self.token_s or 0.0) + self.loop_s


@dataclass(slots=True)
class PrefillPacer:
    """The engine thread's pacer: ``budget()`` before a step, ``record()`` after one."""

    fixed_budget: int = 0
    default_floor_tps: float = 0.0
    _token_s: float | None = None
    _loop_s: float | None = None

    @property
    def model(self) -> PrefillModel:
        return PrefillModel(
            self.fixed_budget, self.default_floor_tps, self._token_s, self._loop_s or 0.0
        )

    def period_s(self, floors: Iterable[float | None]) -> float | None:
        return self.model.period_s(floors)

    def budget(self, period_s: float | None, t_dec: float | None, capacity: int) -> int:
        """Prompt tokens the next step may carry while sessions decode."""
        return self.model.budget(period_s, t_dec, capacity)

    def record(self, prompt_tokens: int, seconds: float, t_dec: float | None) -> None:
        """A step that carried ``prompt_tokens`` took ``seconds``; ``t_dec``: what the same
        step without them would have taken (None when unknown: all of it is the prompt's)."""
        if prompt_tokens <= 0 or seconds <= 0:
            return
        # At least a quarter of the step is the prompt's: a decode-only time measured under
        # other load must not make the prompt look free (the next budget would balloon).
        cost = max(seconds - (t_dec or 0.0), 0.25 * seconds) / prompt_tokens
        old = self._token_s
        self._token_s = cost if old is None else old + COST_ALPHA * (cost - old)

    def record_loop(self, seconds: float) -> None:
        """The loop took ``seconds`` from a paced step's end to the next step's start."""
        if seconds < 0:
            return
        old = self._loop_s
        self._loop_s = seconds if old is None else old + LOOP_ALPHA * (seconds - old)
