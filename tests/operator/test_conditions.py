"""kstatus conditions from a verdict."""

from __future__ import annotations

from polykv_operator.conditions import Verdict, condition_status, conditions_for


def by_type(conds):  # type: ignore[no-untyped-def]
    return {c.type: c for c in conds}


def test_phases_map_to_kstatus() -> None:
    cases = {
        Verdict.ready("Ok", "fine"): ("True", "False", "False"),
        Verdict.reconciling("Busy", "working"): ("False", "True", "False"),
        Verdict.stalled("Broken", "fix it"): ("False", "False", "True"),
        Verdict.unknown("Gone", "no answer"): ("Unknown", "True", "False"),
    }
    for verdict, (ready, rec, stalled) in cases.items():
        c = by_type(conditions_for(verdict, None, 3, now="T0"))
        assert (c["Ready"].status, c["Reconciling"].status, c["Stalled"].status) == (
            ready,
            rec,
            stalled,
        )
        assert all(x.observed_generation == 3 for x in c.values())
    stalled = by_type(conditions_for(Verdict.stalled("Broken", "fix it"), None, 1, now="T0"))
    assert stalled["Stalled"].reason == "Broken" and stalled["Stalled"].message == "fix it"


def test_transition_time_kept_while_status_holds() -> None:
    first = conditions_for(Verdict.reconciling("A", "a"), None, 1, now="T0")
    again = conditions_for(Verdict.reconciling("B", "b"), first, 1, now="T1")
    assert by_type(again)["Reconciling"].last_transition_time == "T0"
    flipped = conditions_for(Verdict.ready("Ok", ""), again, 1, now="T2")
    assert by_type(flipped)["Ready"].last_transition_time == "T2"
    assert by_type(flipped)["Stalled"].last_transition_time == "T0"
    assert condition_status(flipped, "Ready") == "True"
    assert conditions_for(Verdict.ready("Ok", ""), flipped, 1, now="T3") == flipped
