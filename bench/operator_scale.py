"""The operator at scale, on the local control plane with real engine processes, at the
shipped settings (POLYKV_OPERATOR_POLL_INTERVAL=5): how soon an applied pool is Ready, how
long a 100-pool tree and 1,000 pools over five engines take to be Ready, what an idle
operator costs with 10 and with 1,000 pools, how many status writes an idle tree makes, what
one engine create costs with few and many pools, and how long a 3-level 30-pool tree on 2
replicas takes to delete.

python -m bench.operator_scale            # about 2 minutes on 2 cores
python -m bench.operator_scale --quick    # smoke run: small sizes, no files
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from polykv_operator.manifests import admin_key
from polykv_testenv import ApiError, ControlPlane, ProcessNode
from polykv_testenv.operator import OperatorProcess
from polykv_testenv.waiting import wait_for

from . import harness as H
from . import report as R

NAME = "operator_scale"
NS = "bench"
MASTER = "bench-master-key"
GROUP = f"/apis/polykv.io/v1alpha1/namespaces/{NS}"
SYSTEM = "You are one of many agents in this benchmark; keep answers short."


@dataclass
class Config:
    poll_interval_s: float = 5.0
    applies: int = 10  # single pools applied one at a time
    tree: int = 100  # pools in the one-engine tree
    engines: int = 5  # for the 1,000-pool run
    per_engine: int = 200
    idle_s: float = 30.0
    delete_reps: int = 2


def engine(name: str, replicas: int = 1, max_pools: int = 32, ctx: int = 4096) -> dict[str, Any]:
    return {
        "apiVersion": "polykv.io/v1alpha1",
        "kind": "PolyKVEngine",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {
                "path": "/models/polykv-test.gguf",
                "init": {
                    "command": ["polykv-make-model", "--preset", "test", "/models/polykv-test.gguf"]
                },
            },
            "replicas": replicas,
            "parallel": 1,
            "contextSize": ctx,
            "maxPools": max_pools,
            "threads": 1,
        },
    }


def pool(name: str, eng: str, parent: str | None = None, text: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"engineRef": {"name": eng}}
    if parent is None:
        spec["text"] = text or f"{SYSTEM} Pool {name}."
    else:
        spec["parent"], spec["appendText"] = parent, f" {name}."
    return {
        "apiVersion": "polykv.io/v1alpha1",
        "kind": "PolyKVPool",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


class Bench:
    def __init__(self, cluster: ControlPlane, node: ProcessNode, logs: Path) -> None:
        self.cluster, self.node, self.logs = cluster, node, logs
        self.api = cluster.api

    def create(self, obj: dict[str, Any]) -> None:
        plural = obj["kind"].lower() + "s"
        self.api.create(f"{GROUP}/{plural}", obj)

    def create_many(self, objs: Sequence[dict[str, Any]], workers: int = 8) -> None:
        with ThreadPoolExecutor(workers) as ex:
            list(ex.map(self.create, objs))

    def ready_names(self) -> set[str]:
        items = self.api.get(f"{GROUP}/polykvpools")["items"]
        out = set()
        for p in items:
            for c in (p.get("status") or {}).get("conditions") or []:
                if c["type"] == "Ready" and c["status"] == "True":
                    out.add(p["metadata"]["name"])
        return out

    def wait_ready(self, names: set[str], timeout_s: float) -> float:
        """Seconds until every name is Ready (polled every 0.2 s)."""
        t0 = time.monotonic()
        wait_for(
            f"{len(names)} pools Ready",
            lambda: True if names <= self.ready_names() else None,
            timeout_s,
        )
        return time.monotonic() - t0

    def engine_ready(self, name: str, timeout_s: float = 240) -> None:
        def probe() -> bool | None:
            st = self.api.get(f"{GROUP}/polykvengines/{name}").get("status") or {}
            conds = {c["type"]: c["status"] for c in st.get("conditions") or []}
            return True if conds.get("Ready") == "True" else None

        wait_for(f"engine {name} Ready", probe, timeout_s)

    def pool_ready_latency(self, obj: dict[str, Any]) -> float:
        path = f"{GROUP}/polykvpools/{obj['metadata']['name']}"
        t0 = time.monotonic()
        self.create(obj)
        while True:
            st = self.api.get(path).get("status") or {}
            if any(
                c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or []
            ):
                return time.monotonic() - t0
            if time.monotonic() - t0 > 120:
                raise H.BenchError(f"{path} not Ready in 120 s")
            time.sleep(0.02)

    def delete_pools(self) -> None:
        self.cluster.kubectl("delete", "polykvpools", "--all", "-n", NS, "--wait=false")

    def no_pools(self, timeout_s: float = 300) -> float:
        t0 = time.monotonic()
        wait_for(
            "pools gone",
            lambda: True if not self.api.get(f"{GROUP}/polykvpools")["items"] else None,
            timeout_s,
        )
        return time.monotonic() - t0

    def engine_ips(self, name: str) -> list[str]:
        pods = self.api.get(
            f"/api/v1/namespaces/{NS}/pods", labelSelector=f"polykv.io/engine={name}"
        )
        return [p["status"]["podIP"] for p in pods["items"] if p["status"].get("podIP")]

    def key(self, name: str) -> str:
        uid = self.api.get(f"{GROUP}/polykvengines/{name}")["metadata"]["uid"]
        return admin_key(MASTER, NS, name, uid)


class StatusWrites:
    """Counts MODIFIED events of the namespace's pools while running (each is one write)."""

    def __init__(self, api: Any) -> None:
        self.api, self.count = api, 0
        self._stop = threading.Event()
        self._rv = api.get(f"{GROUP}/polykvpools")["metadata"]["resourceVersion"]
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for ev in self.api.watch(f"{GROUP}/polykvpools", self._rv, timeout_s=5):
                    self._rv = ev["object"]["metadata"].get("resourceVersion", self._rv)
                    if ev["type"] == "MODIFIED" and not self._stop.is_set():
                        self.count += 1
            except (ApiError, httpx.HTTPError):
                time.sleep(0.2)

    def stop(self) -> int:
        self._stop.set()
        return self.count


def settle(writes: StatusWrites, quiet_s: float, limit_s: float = 180.0) -> float:
    """Wait until no pool status changed for `quiet_s` (the last Ready is followed by the
    other pools' final writes); returns how long that took."""
    t0 = last_change = time.monotonic()
    seen = writes.count
    while time.monotonic() - last_change < quiet_s and time.monotonic() - t0 < limit_s:
        time.sleep(0.5)
        if writes.count != seen:
            seen, last_change = writes.count, time.monotonic()
    return time.monotonic() - t0


def idle_cost(b: Bench, pid: int, cfg: Config) -> tuple[float, int, float]:
    """(operator CPU in ms per s, pool status writes, seconds to settle first) while idle."""
    writes = StatusWrites(b.api)
    settled_s = settle(writes, quiet_s=2 * cfg.poll_interval_s + 2)
    before = writes.count
    cpu = cpu_ms_per_s(pid, cfg.idle_s)
    return cpu, writes.stop() - before, settled_s


def cpu_ms_per_s(pid: int, seconds: float) -> float:
    """CPU the process used, in ms per second of wall time."""
    ticks = os.sysconf("SC_CLK_TCK")

    def used() -> float:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / ticks

    c0, t0 = used(), time.monotonic()
    time.sleep(seconds)
    return (used() - c0) / (time.monotonic() - t0) * 1000


def create_cost_ms(b: Bench, eng: str, reps: int = 9) -> tuple[float, float]:
    """Median times of one pool create on the engine directly (what the operator's create
    costs on the engine side), and of the same create retried (idempotent: the engine's
    control path alone, no prefill); the pool is released again at once."""
    ip = b.engine_ips(eng)[0]
    headers = {"Authorization": f"Bearer {b.key(eng)}"}
    new: list[float] = []
    again: list[float] = []
    with httpx.Client(timeout=60) as c:
        for i in range(reps):
            name = f"probe-{i}-{time.monotonic_ns()}"
            body = {"name": name, "prompt": f"{SYSTEM} Probe {i}."}
            for took, status in ((new, 201), (again, 200)):
                t0 = time.monotonic()
                r = c.post(f"http://{ip}:8080/polykv/pools", json=body, headers=headers)
                took.append((time.monotonic() - t0) * 1000)
                if r.status_code != status:
                    raise RuntimeError(f"probe create answered {r.status_code}: {r.text}")
            c.delete(f"http://{ip}:8080/polykv/pools/{name}", headers=headers).raise_for_status()
    return round(statistics.median(new), 2), round(statistics.median(again), 2)


def measure(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {"env": R.environment()}
    with tempfile.TemporaryDirectory(prefix="polykv-bench-") as tmp:
        root = Path(tmp)
        with (
            ControlPlane(root / "cluster") as cluster,
            ProcessNode(cluster.credentials, root / "node") as node,
        ):
            cluster.kubectl("apply", "-f", str(H.REPO_ROOT / "crds"))
            for crd in ("polykvengines", "polykvpools", "admissionpolicies"):
                cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}.polykv.io")
            cluster.kubectl("create", "namespace", NS)
            env = {
                "POLYKV_OPERATOR_MASTER_KEY": MASTER,
                "POLYKV_OPERATOR_POLL_INTERVAL": str(cfg.poll_interval_s),
            }
            log = H.RESULTS_DIR / f"{NAME}-operator.log"
            op = OperatorProcess(cluster, "polykv_operator.main", NS, log, env)
            with op:
                b = Bench(cluster, node, root)
                out.update(run_all(b, cfg, op))
    return out


def run_all(b: Bench, cfg: Config, op: OperatorProcess) -> dict[str, Any]:
    pid = op.proc.pid
    assert pid is not None
    res: dict[str, Any] = {}
    # 1. apply -> Ready, one pool at a time, on an idle engine.
    b.create(engine("one", max_pools=cfg.tree + cfg.applies + 8, ctx=8192))
    b.engine_ready("one")
    H.progress("engine up; apply -> Ready, one pool at a time")
    lat = [b.pool_ready_latency(pool(f"single-{i}", "one")) for i in range(cfg.applies)]
    res["apply_to_ready_s"] = [round(x, 3) for x in lat]
    H.progress(f"apply -> Ready p50 {statistics.median(lat):.2f}s")
    res["create_cost_ms_few"], res["recreate_cost_ms_few"] = create_cost_ms(b, "one")
    cpu, _, _ = idle_cost(b, pid, cfg)
    res["idle_cpu_ms_per_s_few"] = round(cpu, 2)
    res["pools_few"] = cfg.applies
    # 2. a tree on one engine: 1 root, the rest its children and grandchildren.
    H.progress(f"{cfg.tree}-pool tree on one engine")
    tree = [pool("tree", "one")]
    for i in range(1, cfg.tree):
        parent = "tree" if i < 10 else f"tree-{i % 9 + 1}"
        tree.append(pool(f"tree-{i}", "one", parent=parent))
    t0 = time.monotonic()
    b.create_many(tree)
    res["tree_last_ready_s"] = round(
        b.wait_ready({p["metadata"]["name"] for p in tree}, 300) + 0, 2
    )
    res["tree_last_ready_from_first_create_s"] = round(time.monotonic() - t0, 2)
    res["create_cost_ms_many"], res["recreate_cost_ms_many"] = create_cost_ms(b, "one")
    res["pools_many_one_engine"] = cfg.applies + cfg.tree
    b.delete_pools()
    b.no_pools()
    # 3. 1,000 pools over five engines.
    n_total = cfg.engines * cfg.per_engine
    H.progress(f"{n_total} pools over {cfg.engines} engines")
    names = [f"e{k}" for k in range(cfg.engines)]
    for n in names:
        b.create(engine(n, max_pools=cfg.per_engine + 8, ctx=16384))
    for n in names:
        b.engine_ready(n)
    pools = []
    for n in names:
        pools.append(pool(f"{n}-root", n))
        pools += [pool(f"{n}-{i}", n, parent=f"{n}-root") for i in range(1, cfg.per_engine)]
    t0 = time.monotonic()
    b.create_many(pools)
    res["fleet_created_s"] = round(time.monotonic() - t0, 2)
    b.wait_ready({p["metadata"]["name"] for p in pools}, 600)
    res["fleet_last_ready_s"] = round(time.monotonic() - t0, 2)
    res["fleet_pools"] = n_total
    H.progress(f"{n_total} pools Ready {res['fleet_last_ready_s']}s after the first create")
    cpu, n_writes, settled_s = idle_cost(b, pid, cfg)
    res["idle_cpu_ms_per_s_fleet"] = round(cpu, 2)
    res["fleet_settled_s"] = round(settled_s, 1)
    res["idle_pool_writes_per_pool_per_min"] = round(n_writes / n_total / (cfg.idle_s / 60), 4)
    res["idle_pool_writes"] = n_writes
    b.delete_pools()
    res["fleet_deleted_s"] = round(b.no_pools(600), 2)
    for n in names:
        b.cluster.kubectl("delete", "polykvengine", n, "-n", NS, "--wait=false")
    # 4. delete a 3-level 30-pool tree on 2 replicas.
    H.progress("3-level 30-pool tree on 2 replicas: delete")
    b.create(engine("two", replicas=2, max_pools=40))
    b.engine_ready("two")
    deletes = []
    for rep in range(cfg.delete_reps):
        t = [pool(f"d{rep}", "two")]
        for c in range(5):
            t.append(pool(f"d{rep}-{c}", "two", parent=f"d{rep}"))
            t += [
                pool(f"d{rep}-{c}-{k}", "two", parent=f"d{rep}-{c}") for k in range(5 if c else 4)
            ]
        b.create_many(t)
        b.wait_ready({p["metadata"]["name"] for p in t}, 300)
        t0 = time.monotonic()
        b.cluster.kubectl("delete", f"polykvpool/d{rep}", "-n", NS, "--wait=false")
        b.no_pools()
        deletes.append(round(time.monotonic() - t0, 2))
    res["delete_30_pool_tree_2_replicas_s"] = deletes
    return res


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    lat = raw["apply_to_ready_s"]
    return {
        "apply_to_ready_p50_s": round(statistics.median(lat), 3),
        "apply_to_ready_max_s": round(max(lat), 3),
        "tree_last_ready_s": raw["tree_last_ready_from_first_create_s"],
        "fleet_last_ready_s": raw["fleet_last_ready_s"],
        "idle_cpu_ms_per_s": {
            str(raw["pools_few"]): raw["idle_cpu_ms_per_s_few"],
            str(raw["fleet_pools"]): raw["idle_cpu_ms_per_s_fleet"],
        },
        "idle_pool_writes_per_pool_per_min": raw["idle_pool_writes_per_pool_per_min"],
        "fleet_settled_s": raw.get("fleet_settled_s"),
        "create_cost_ms": {
            str(raw["pools_few"]): raw["create_cost_ms_few"],
            str(raw["pools_many_one_engine"]): raw["create_cost_ms_many"],
        },
        "recreate_cost_ms": {
            str(raw["pools_few"]): raw["recreate_cost_ms_few"],
            str(raw["pools_many_one_engine"]): raw["recreate_cost_ms_many"],
        },
        "delete_30_pool_tree_s": statistics.median(raw["delete_30_pool_tree_2_replicas_s"]),
    }


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    few, many = str(raw["pools_few"]), str(raw["fleet_pools"])
    cost_few, cost_many = str(raw["pools_few"]), str(raw["pools_many_one_engine"])
    cpu, cost, again = res["idle_cpu_ms_per_s"], res["create_cost_ms"], res["recreate_cost_ms"]
    rows = [
        (
            "apply → Ready, one pool (p50 / max)",
            f"{res['apply_to_ready_p50_s']:.2f} s / {res['apply_to_ready_max_s']:.2f} s",
            "p50 < 1 s",
        ),
        (f"{cfg.tree}-pool tree, last Ready", f"{res['tree_last_ready_s']:.1f} s", ""),
        (
            f"{raw['fleet_pools']} pools over {cfg.engines} engines, last Ready",
            f"{res['fleet_last_ready_s']:.1f} s",
            "< 60 s",
        ),
        (
            "idle operator CPU (ms per s)",
            f"{cpu[few]} at {few} pools on 1 engine, {cpu[many]} at {many} on {cfg.engines}",
            "",
        ),
        (
            "… per engine (ms per s)",
            f"{cpu[few]:.2f} at {float(few):.0f} pools each, "
            f"{cpu[many] / cfg.engines:.2f} at {float(many) / cfg.engines:.0f} each",
            "flat in pools",
        ),
        (
            "idle status writes per pool per minute",
            f"{res['idle_pool_writes_per_pool_per_min']}",
            "0",
        ),
        (
            "one engine create, new prefix (ms, median of 9)",
            f"{cost[cost_few]} at {cost_few} pools, {cost[cost_many]} at {cost_many}",
            "",
        ),
        (
            "… its control path: the same create retried (ms)",
            f"{again[cost_few]} at {cost_few} pools, {again[cost_many]} at {cost_many}",
            "flat in pools",
        ),
        (
            "delete a 3-level 30-pool tree on 2 replicas",
            f"{res['delete_30_pool_tree_s']:.1f} s",
            "< 10 s",
        ),
    ]
    table = R.markdown_table(("measure", "result", "target"), [list(r) for r in rows])
    return (
        "### Operator at scale: apply → Ready, 1,000 pools, idle cost, deletion\n\n"
        f"Local control plane, real engine processes (test model), operator at the shipped "
        f"{cfg.poll_interval_s:g} s poll; `python -m bench.operator_scale` (about 2 minutes).\n\n"
        f"{table}\n\n"
        "Idle (measured once no status has changed for two polls; the fleet took "
        f"{res['fleet_settled_s']} s after its last Ready), each engine gets a quiet check per "
        "poll instead of a round: one conditional request per replica answered 304 while its "
        "pool listing is unchanged, nothing parsed, nothing compared. A full round runs when an "
        "object of the namespace or a listing changed, and every 5 minutes as a safety net.\n\n"
        "A create of a new prefix includes its prefill, and in a unified cache that prefill's "
        "attention spans every used cell, other pools' too (llama.cpp's own cost, as for any "
        "decode); the retried create is the engine's own work for a create (validation, the "
        "answer's status, the snapshot), which should not grow with the number of pools.\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.operator_scale", description=__doc__)
    p.add_argument("--per-engine", type=int, default=200, help="pools per engine (5 engines)")
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (rc := R.from_json(NAME, args, Config, analyse, render)) is not None:
        return rc
    cfg = Config(per_engine=args.per_engine)
    if args.quick:
        cfg.applies, cfg.tree, cfg.engines, cfg.per_engine = 3, 20, 2, 20
        cfg.idle_s, cfg.delete_reps = 5.0, 1
    return R.run_and_publish(NAME, cfg, args, measure, analyse, render, bulky=())


if __name__ == "__main__":
    sys.exit(main())
