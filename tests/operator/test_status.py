"""Status of pools, engines and policies from indexes and the fleet (pure)."""

from __future__ import annotations

from polykv_api.models import AdmissionPolicy
from polykv_operator.api import Condition
from polykv_operator.fleet import CreateError, EngineState, Observation, Render, RenderFailure
from polykv_operator.policies import engine_policy, select
from polykv_operator.status import (
    PoolContext,
    engine_status,
    mean_active_tps,
    patch_for,
    policy_status,
    pool_status,
    pool_verdict,
    previous_conditions,
)
from polykv_operator.tree import PoolNode

from .builders import NS, engine_spec, pod, policy, pool
from .fake_engine import FakeEngine, FakePool, summary


def state_with(replicas: dict[str, FakeEngine | None], renders=None) -> EngineState:  # type: ignore[no-untyped-def]
    st = EngineState((NS, "eng"), rounds=1)
    for i, (name, eng) in enumerate(sorted(replicas.items())):
        ip = f"10.0.0.{i + 1}"
        st.pods[name] = pod(name, ip)
        st.replicas[name] = Observation(
            name,
            f"uid-{name}",
            ip,
            eng is not None,
            None if eng else "timeout",
            eng.listing() if eng else None,
        )
    st.renders.update(renders or {})
    return st


def ctx(nodes: list[PoolNode], fleet: dict[str, EngineState], policies=()) -> PoolContext:  # type: ignore[no-untyped-def]
    return PoolContext(
        pools={n.name: n for n in nodes},
        engines=["eng"],
        fleet=fleet,
        selection=select(list(policies), {n.name: dict(n.labels) for n in nodes}),
    )


def engine_with(*names: str) -> FakeEngine:
    eng = FakeEngine()
    for i, n in enumerate(names):
        eng.pools[n] = FakePool(i + 1, n, None, [1, 2, 3, 4], 0)
    return eng


ROOT = pool("root", text="hello")
RENDER = Render(4, 0, "abcd")


def test_ready_on_every_replica_with_per_replica_ids() -> None:
    st = state_with({"a": engine_with("root"), "b": engine_with("x", "root")}, {"uid-root": RENDER})
    out = pool_status(ROOT, ctx([ROOT], {"eng": st}), None)
    assert out.path == "root" and out.depth == 0
    assert (out.prefix_len, out.branch_pos, out.prefix_hash) == (4, 0, "abcd")
    assert [(r.pod, r.pool_id) for r in out.replicas or []] == [("a", 1), ("b", 2)]
    ready = {c.type: c for c in out.conditions or []}["Ready"]
    assert ready.status == "True" and ready.message == "materialized on 2/2 replicas"


def test_partially_materialized_is_reconciling() -> None:
    st = state_with({"a": engine_with("root"), "b": engine_with()}, {"uid-root": RENDER})
    v = pool_verdict(ROOT, ctx([ROOT], {"eng": st}))
    assert v.phase == "reconciling" and "1/2" in v.message


def test_unreachable_replica_is_unknown() -> None:
    st = state_with({"a": engine_with("root"), "b": None}, {"uid-root": RENDER})
    v = pool_verdict(ROOT, ctx([ROOT], {"eng": st}))
    assert v.phase == "unknown" and v.reason == "EngineUnreachable" and "timeout" in v.message


def test_render_failure_stalls_the_pool_and_its_children() -> None:
    child = pool("child", parent="root", appendText="!")
    grand = pool("grand", parent="child", appendText="?")
    st = state_with({"a": engine_with()}, {"uid-root": RenderFailure("PrefixTooLong", "too long")})
    c = ctx([ROOT, child, grand], {"eng": st})
    assert pool_verdict(ROOT, c).reason == "PrefixTooLong"
    v = pool_verdict(grand, c)
    assert v.phase == "stalled" and v.reason == "ParentStalled"
    assert 'parent "child" is stalled (ParentStalled)' in v.message


def test_waiting_for_the_parent_and_for_the_engine() -> None:
    child = pool("child", parent="root", appendText="!")
    st = state_with({"a": engine_with()})
    assert pool_verdict(child, ctx([ROOT, child], {"eng": st})).reason == "WaitingForParent"
    assert pool_verdict(ROOT, ctx([ROOT], {})).reason == "WaitingForEngine"
    empty = EngineState((NS, "eng"), rounds=1)
    assert pool_verdict(ROOT, ctx([ROOT], {"eng": empty})).reason == "NoReadyReplica"


def test_engine_full_stalls_with_a_fix() -> None:
    st = state_with({"a": engine_with()}, {"uid-root": RENDER})
    st.create_errors["uid-root"] = {
        "a": CreateError("no free pool sequence id: all 8 reserved are in use", "seq_ids_exhausted")
    }
    v = pool_verdict(ROOT, ctx([ROOT], {"eng": st}))
    assert v.reason == "EngineFull" and "maxPools" in v.message


def test_live_figures_are_summed_and_rounded() -> None:
    eng = engine_with("root")
    eng.pools["root"].rates = [10.04, 12.0]
    eng.pools["root"].warming = 1  # listed as a session, left out of the rate
    st = state_with({"a": eng}, {"uid-root": RENDER})
    out = pool_status(ROOT, ctx([ROOT], {"eng": st}), None)
    assert out.sessions == 3 and out.mean_active_tps == 11.0
    assert out.compaction_pressure == 0.25
    assert (
        out.capacity is not None and out.capacity.can_admit and out.capacity.headroom_sessions == 3
    )


def test_replicas_combine_by_the_engines_sums_not_by_session_rates() -> None:
    a, b = engine_with("root"), engine_with("root")
    a.pools["root"].rates = [10.0]
    a.pools["root"].warming = 2
    b.pools["root"].rates = [20.0, 20.0, 20.0]
    st = state_with({"a": a, "b": b}, {"uid-root": RENDER})
    out = pool_status(ROOT, ctx([ROOT], {"eng": st}), None)
    # 70 tokens/s over 4 active sessions; not the mean of the replicas' means (15.0), and
    # not a mean over every decoding session's tps_ewma (warming ones included).
    assert out.mean_active_tps == 17.5
    rows = {
        r.pod: r
        for r in engine_status(engine_spec(), "eng", 1, st, [], None, "s").replica_status or []
    }
    assert (rows["a"].mean_active_tps, rows["b"].mean_active_tps) == (10.0, 20.0)


def test_no_active_session_means_no_figure() -> None:
    eng = engine_with("root")
    eng.pools["root"].warming = 1
    st = state_with({"a": eng}, {"uid-root": RENDER})
    assert mean_active_tps([eng.listing()]) is None
    assert pool_status(ROOT, ctx([ROOT], {"eng": st}), None).mean_active_tps is None


def test_capacity_is_the_worst_replica_from_the_listing() -> None:
    a, b, c = engine_with("root"), engine_with("root"), engine_with("root")
    a.pools["root"].capacity = summary(headroom_sessions=2, compaction_pressure=0.104)
    b.pools["root"].capacity = summary(
        can_admit=False,
        reason="settling",
        headroom_sessions=1,
        settling=True,
        compaction_pressure=0.3456,
    )
    c.pools["root"].capacity = None  # an engine that does not list capacity yet
    st = state_with({"a": a, "b": b, "c": c}, {"uid-root": RENDER})
    out = pool_status(ROOT, ctx([ROOT], {"eng": st}), None)
    wire = out.wire()
    assert wire["compactionPressure"] == 0.35  # the highest, rounded
    assert wire["capacity"] == {
        "canAdmit": False,
        "reason": "settling",
        "headroomSessions": 3,
        "settling": True,
    }


def test_no_capacity_listed_means_none_in_status() -> None:
    eng = engine_with("root")
    eng.pools["root"].capacity = None
    st = state_with({"a": eng}, {"uid-root": RENDER})
    out = pool_status(ROOT, ctx([ROOT], {"eng": st}), None)
    assert out.capacity is None and out.compaction_pressure is None
    assert "capacity" not in out.wire() and "compactionPressure" not in out.wire()


def test_engine_status() -> None:
    st = state_with({"a": engine_with("root"), "b": engine_with("root")}, {"uid-root": RENDER})
    st.pods["a"] = pod("a", "10.0.0.1", gate="True")
    out = engine_status(engine_spec(replicas=2), "eng", 4, st, [ROOT], None, "polykv.io/engine=eng")
    assert (out.replicas, out.ready_replicas, out.pools) == (2, 1, 1)
    assert out.selector == "polykv.io/engine=eng" and out.observed_generation == 4
    rows = {r.pod: r for r in out.replica_status or []}
    assert rows["a"].pools_ready and not rows["b"].pools_ready
    assert rows["a"].boot_id == "boot-1" and rows["a"].seq_ids_max == 8
    assert {c.type: c.status for c in out.conditions or []}["Reconciling"] == "True"
    assert out.model_dump(by_alias=True)["replicaStatus"][0]["podIP"] == "10.0.0.1"


def test_a_name_clash_stalls_the_engine_naming_the_object() -> None:
    st = state_with({"a": engine_with("root")}, {"uid-root": RENDER})
    st.pods["a"] = pod("a", "10.0.0.1", gate="True")
    st.clash = "name clash: held by objects this PolyKVEngine does not control: Service eng"
    out = engine_status(engine_spec(), "eng", 1, st, [ROOT], None, "s")
    stalled = {c.type: c for c in out.conditions or []}["Stalled"]
    assert (stalled.status, stalled.reason) == ("True", "NameClash")
    assert "Service eng" in stalled.message
    assert not st.nothing_pending()  # a clash is retried, never settled


def test_engine_status_reports_the_rounds_figure_and_leaves_it() -> None:
    st = state_with({"a": engine_with("root")}, {"uid-root": RENDER})
    st.mean_active_tps = 7.5  # the round's to write
    out = engine_status(engine_spec(), "eng", 1, st, [ROOT], None, "s")
    assert out.mean_active_tps == 7.5 and st.mean_active_tps == 7.5


def test_engine_status_stalls_on_crash_loop() -> None:
    st = EngineState((NS, "eng"), rounds=1)
    st.pods["a"] = pod(
        "a", None, ready=False, waiting_reason="CrashLoopBackOff", waiting_message="back-off 10s"
    )
    out = engine_status(engine_spec(), "eng", 1, st, [], None, "s")
    stalled = {c.type: c for c in out.conditions or []}["Stalled"]
    assert stalled.status == "True" and stalled.reason == "CrashLoopBackOff"


def test_policy_status_applied_and_conflicts() -> None:
    p = pool("root", text="x", labels={"tier": "a"})
    one = policy("one", poolSelector={"matchLabels": {"tier": "a"}})
    eng = engine_with("root")
    eng.pools["root"].admission = engine_policy(one.spec)
    st = state_with({"a": eng}, {"uid-root": RENDER})
    c = ctx([p], {"eng": st}, [one])
    out = policy_status(one, c.selection, c.pools, c.fleet, None)
    assert out.selected_pools == ["root"] and out.applied_pools == 1
    assert {x.type: x.status for x in out.conditions or []}["Ready"] == "True"
    two = policy("two", poolRefs=[{"name": "root"}])
    c2 = ctx([p], {"eng": st}, [one, two])
    out2 = policy_status(two, c2.selection, c2.pools, c2.fleet, None)
    stalled = {x.type: x for x in out2.conditions or []}["Stalled"]
    assert stalled.status == "True" and stalled.reason == "PoolSelectedTwice"
    assert "one" in stalled.message
    assert out2.conflicts is not None and out2.conflicts[0].policies == ["one", "two"]


def test_policy_waiting_for_push() -> None:
    p = pool("root", text="x", labels={"tier": "a"})
    one = policy("one", poolSelector={"matchLabels": {"tier": "a"}})
    eng = engine_with("root")
    eng.pools["root"].admission = AdmissionPolicy(target_tps_per_session=1.0)
    c = ctx([p], {"eng": state_with({"a": eng}, {"uid-root": RENDER})}, [one])
    out = policy_status(one, c.selection, c.pools, c.fleet, None)
    assert {x.type: x.reason for x in out.conditions or []}["Reconciling"] == "Applying"


def test_patch_only_what_changed() -> None:
    eng = engine_with("root")
    st = state_with({"a": eng}, {"uid-root": RENDER})
    first = pool_status(ROOT, ctx([ROOT], {"eng": st}), None)
    current = first.wire()
    assert patch_for(None, first) == current

    def again() -> dict[str, object]:
        st.replicas["a"].listing = eng.listing()  # the next round's listing
        new = pool_status(ROOT, ctx([ROOT], {"eng": st}), previous_conditions(current))
        return patch_for(current, new)

    assert again() == {}
    eng.pools["root"].capacity = summary(compaction_pressure=0.2512)  # jitter: rounded away
    assert again() == {}
    eng.pools["root"].capacity = summary(headroom_sessions=1, compaction_pressure=0.5)
    assert again() == {
        "capacity": {"canAdmit": True, "reason": "ok", "headroomSessions": 1, "settling": False},
        "compactionPressure": 0.5,
    }
    current["stale"] = 1
    eng.pools["root"].capacity = summary()
    assert again() == {"stale": None}


def test_previous_conditions_skips_junk() -> None:
    good = Condition(type="Ready", status="True", reason="R", last_transition_time="T").wire()
    assert len(previous_conditions({"conditions": [good, {"type": "x"}]})) == 1
