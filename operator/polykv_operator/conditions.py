"""kstatus conditions (Ready / Reconciling / Stalled) as a pure function of a verdict.

Every status write carries the whole list (a merge patch replaces lists), and a condition
keeps its lastTransitionTime while its status does not change, so an unchanged verdict
produces an identical list and therefore no write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from .api import Condition
from .api.meta import ConditionStatus

Phase = Literal["ready", "reconciling", "stalled", "unknown"]

READY, RECONCILING, STALLED = "Ready", "Reconciling", "Stalled"


@dataclass(frozen=True)
class Verdict:
    """Where an object stands, in one word, with a reason a program can match and a message
    a person can act on."""

    phase: Phase
    reason: str
    message: str

    @classmethod
    def ready(cls, reason: str, message: str) -> Verdict:
        return cls("ready", reason, message)

    @classmethod
    def reconciling(cls, reason: str, message: str) -> Verdict:
        return cls("reconciling", reason, message)

    @classmethod
    def stalled(cls, reason: str, message: str) -> Verdict:
        return cls("stalled", reason, message)

    @classmethod
    def unknown(cls, reason: str, message: str) -> Verdict:
        """Ready=Unknown: we cannot tell (e.g. a replica does not answer); still trying."""
        return cls("unknown", reason, message)


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def conditions_for(
    verdict: Verdict,
    previous: Sequence[Condition] | None,
    generation: int | None,
    now: str | None = None,
) -> list[Condition]:
    """The three kstatus conditions for `verdict`, keeping transition times from `previous`."""
    ready: ConditionStatus = (
        "True" if verdict.phase == "ready" else "Unknown" if verdict.phase == "unknown" else "False"
    )
    busy = verdict.phase in ("reconciling", "unknown")
    stalled = verdict.phase == "stalled"
    wanted: list[tuple[str, ConditionStatus, str, str]] = [
        (READY, ready, verdict.reason, verdict.message),
        (
            RECONCILING,
            "True" if busy else "False",
            verdict.reason if busy else "Idle",
            verdict.message if busy else "",
        ),
        (
            STALLED,
            "True" if stalled else "False",
            verdict.reason if stalled else "Progressing",
            verdict.message if stalled else "",
        ),
    ]
    old = {c.type: c for c in previous or []}
    stamp = now or now_rfc3339()
    out = []
    for ctype, status, reason, message in wanted:
        prev = old.get(ctype)
        since = prev.last_transition_time if prev is not None and prev.status == status else stamp
        out.append(
            Condition(
                type=ctype,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=since,
                observed_generation=generation,
            )
        )
    return out


def condition_status(conditions: Sequence[Condition] | None, ctype: str) -> str | None:
    for c in conditions or []:
        if c.type == ctype:
            return c.status
    return None
