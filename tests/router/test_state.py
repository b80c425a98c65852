"""Bindings, reservations and the fleet records (pure: every test passes the time)."""

from __future__ import annotations

from polykv_router.bindings import Binding, Bindings, SessionKey
from polykv_router.fleet import Fleet, PoolAnswer
from polykv_router.picker import PoolCapacity
from polykv_router.pods import Pod, pod_from_object
from polykv_router.reservations import Reservations
from polykv_router.verdicts import KeyVerdicts, credentials, fingerprint


def binding(replica: str, t: float) -> Binding:
    return Binding(replica, f"uid-{replica}", "boot-1", "crew", t)


def sk(session: str, owner: str = "tenant-a") -> SessionKey:
    return (owner, session)


def test_one_session_id_under_two_keys_is_two_bindings() -> None:
    table = Bindings(ttl_s=100)
    table.bind(sk("main"), binding("a", 0))
    assert table.get(sk("main", owner="tenant-b"), 1) is None
    table.bind(sk("main", owner="tenant-b"), binding("b", 1))
    mine = table.get(sk("main"), 2)
    assert mine is not None and mine.replica == "a"
    assert table.per_replica() == {"a": 1, "b": 1}


def test_a_binding_lives_while_used_and_expires_after_the_idle_ttl() -> None:
    table = Bindings(ttl_s=100)
    table.bind(sk("s1"), binding("a", 0))
    table.bind(sk("s2"), binding("b", 0))
    table.touch(sk("s1"), 90)
    assert table.get(sk("s1"), 150) is not None  # idle 60 s
    assert table.get(sk("s2"), 150) is None  # idle 150 s: gone on read
    table.bind(sk("s3"), binding("b", 150))
    assert table.expire(200) == 1  # s1 idle 110 s; s3 idle 50 s
    assert table.get(sk("s1"), 200) is None and table.get(sk("s3"), 200) is not None


def test_expiry_walks_only_the_expired_front() -> None:
    table = Bindings(ttl_s=10)
    for i in range(5):
        table.bind(sk(f"s{i}"), binding("a", float(i)))
    assert table.expire(12.5) == 3  # s0..s2 idle > 10 s
    assert len(table) == 2
    assert table.per_replica() == {"a": 2}


def test_per_replica_counts_follow_rebinding_and_drops() -> None:
    table = Bindings(ttl_s=100)
    table.bind(sk("s1"), binding("a", 0))
    table.bind(sk("s2"), binding("a", 0))
    table.bind(sk("s1"), binding("b", 1))  # re-homed
    assert table.per_replica() == {"a": 1, "b": 1}
    table.drop(sk("s2"))
    table.drop(sk("s2"))
    assert table.per_replica() == {"b": 1}


def test_a_reservation_counts_until_a_later_poll_sees_the_session() -> None:
    res = Reservations(max_age_s=10)
    r = res.add("a", "crew", now=1.0)
    assert res.counts("crew", 1.0) == {"a": 1}
    res.accepted(r, now=1.5)
    res.observed("a", "crew", poll_started_at=1.2)  # asked before the engine accepted
    assert res.counts("crew", 1.6) == {"a": 1}
    res.observed("b", "crew", poll_started_at=2.0)  # another replica's answer
    res.observed("a", "other", poll_started_at=2.0)  # another pool's answer
    assert res.counts("crew", 2.1) == {"a": 1}
    res.observed("a", "crew", poll_started_at=2.0)
    assert res.counts("crew", 2.1) == {}


def test_a_refused_reservation_is_released_and_an_old_one_ages_out() -> None:
    res = Reservations(max_age_s=10)
    refused = res.add("a", "crew", 0.0)
    res.add("b", "crew", 0.0)  # never answered
    res.release(refused)
    res.release(refused)
    assert res.counts("crew", 5.0) == {"b": 1}
    assert res.counts("crew", 10.5) == {}
    assert len(res) == 0


def pod_obj(
    name: str = "eng-1",
    ip: str | None = "127.0.0.5",
    ready: bool = True,
    deleting: bool = False,
    phase: str = "Running",
    port: int | None = 9000,
) -> dict[str, object]:
    meta: dict[str, object] = {"name": name, "uid": f"uid-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-30T00:00:00Z"
    ports = [{"name": "http", "containerPort": port}] if port else []
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "engine", "ports": ports}]},
        "status": {
            "phase": phase,
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_a_pod_is_read_with_its_port_readiness_and_termination() -> None:
    pod = pod_from_object(pod_obj(), default_port=8080)
    assert pod == Pod("eng-1", "uid-eng-1", "127.0.0.5", 9000, ready=True, terminating=False)
    assert pod.serving and pod.base_url == "http://127.0.0.5:9000"
    no_port = pod_from_object(pod_obj(port=None), default_port=8080)
    assert no_port is not None and no_port.port == 8080
    deleting = pod_from_object(pod_obj(deleting=True), 8080)
    assert deleting is not None and deleting.ready and not deleting.serving
    unready = pod_from_object(pod_obj(ready=False), 8080)
    assert unready is not None and not unready.serving


def test_pods_without_an_address_or_finished_hold_nothing() -> None:
    assert pod_from_object(pod_obj(ip=None), 8080) is None
    assert pod_from_object(pod_obj(phase="Failed"), 8080) is None


def test_the_fleet_forgets_what_it_knew_of_a_replaced_pod() -> None:
    fleet = Fleet()
    pod = Pod("a", "u1", "127.0.0.2", 8080, True, False)
    fleet.upsert(pod)
    a = fleet.get("a")
    assert a is not None
    a.boot_id = "b1"
    fleet.upsert(Pod("a", "u1", "127.0.0.2", 8080, False, True))  # same pod, now terminating
    same = fleet.get("a")
    assert same is a and same.boot_id == "b1" and same.pod.terminating
    fleet.upsert(Pod("a", "u2", "127.0.0.2", 8080, True, False))  # a new pod of the same name
    fresh = fleet.get("a")
    assert fresh is not None and fresh.boot_id is None
    fleet.replace([Pod("b", "u3", "127.0.0.3", 8080, True, False)])
    assert [r.name for r in fleet] == ["b"]


def test_views_count_stale_answers_as_unknown_and_404s_as_missing() -> None:
    fleet = Fleet()
    for name in ("a", "b", "c"):
        fleet.upsert(Pod(name, name, "127.0.0.2", 8080, True, False))
    c = PoolCapacity(True, "ok", 10.0, 2, 1)
    fleet.get("a").pools["crew"] = PoolAnswer(at=9.5, capacity=c)  # type: ignore[union-attr]
    fleet.get("b").pools["crew"] = PoolAnswer(at=9.5, capacity=None)  # type: ignore[union-attr]
    fleet.get("c").pools["crew"] = PoolAnswer(at=1.0, capacity=c)  # type: ignore[union-attr]
    fleet.get("c").in_flight = 2  # type: ignore[union-attr]
    views = {v.name: v for v in fleet.views("crew", {"a": 3}, now=10.0, max_age_s=1.0)}
    assert views["a"].capacity == c and views["a"].load == 3
    assert views["b"].capacity is None and not views["b"].has_pool
    assert views["c"].capacity is None and views["c"].has_pool and views["c"].load == 2
    assert fleet.counts() == {"serving": 3, "terminating": 0, "not_ready": 0}


def test_bindings_past_the_bound_drop_the_least_recently_used() -> None:
    table = Bindings(ttl_s=100, max_sessions=3)
    for i in range(3):
        table.bind(sk(f"s{i}"), binding("a", float(i)))
    table.touch(sk("s0"), 5.0)  # s1 is now the least recently used
    table.bind(sk("s3"), binding("b", 6.0))
    assert len(table) == 3
    assert table.get(sk("s1"), 7.0) is None
    assert all(table.get(sk(s), 7.0) is not None for s in ("s0", "s2", "s3"))
    assert table.per_replica() == {"a": 2, "b": 1}


def test_key_verdicts_expire_and_stay_bounded() -> None:
    v = KeyVerdicts(max_keys=2, ok_ttl_s=60, refused_ttl_s=5)
    v.put("good", True, now=0.0)
    v.put("bad", False, now=0.0)
    assert v.get("good", 4.0) is True and v.get("bad", 4.0) is False
    assert v.get("bad", 5.0) is None  # a refusal is remembered briefly
    assert v.get("good", 59.0) is True and v.get("good", 60.0) is None
    for i in range(5):
        v.put(f"k{i}", False, now=10.0)
    assert len(v) == 2 and v.get("k4", 10.0) is False and v.get("k0", 10.0) is None


def test_a_key_is_held_as_a_fingerprint_of_every_header_that_carries_one() -> None:
    seen = {
        fingerprint(credentials(h))
        for h in (
            {},
            {"authorization": "Bearer k"},
            {"x-api-key": "k"},
            {"authorization": "Bearer k", "x-api-key": "k"},
            {"authorization": "Bearer k2"},
        )
    }
    assert len(seen) == 5
    fp = fingerprint({"authorization": "Bearer secret"})
    assert "secret" not in fp and len(fp) == 64
    assert credentials({"authorization": "a", "x-session-id": "s"}) == {"authorization": "a"}


def test_an_ipv6_pods_url_is_bracketed() -> None:
    pod = Pod("e-0", "u0", "fd00::7", 8080, ready=True, terminating=False)
    assert pod.base_url == "http://[fd00::7]:8080"
    assert Pod("e-1", "u1", "10.1.2.3", 8080, True, False).base_url == "http://10.1.2.3:8080"
