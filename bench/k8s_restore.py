"""Pools that survive, on Kubernetes: how long an engine pod takes to be Ready again (its
readiness gate: every declared pool materialized) after `kubectl delete pod`, a rollout and
a scale-up, with snapshots on (pools restored from the store or fetched from a peer) and off
(every pool prefilled again), side by side in one run.

The local control plane (etcd, kube-apiserver, controller-manager, the process node that
runs pods as local processes), the operator at its shipped poll interval, and one engine on
SmolLM2 (fetched by its init container, as in examples/engine.yaml) holding the example
tree of examples/pools.yaml and two long pools (~2k and ~8k tokens). One engine goes
through every step in turn, each step timed from the kubectl command to the new pod Ready:

* snapshots on, kept in a claim: the first apply (nothing to restore: prefill), the pod
  deleted (the new pod reads the claim), a rollout (a pod label: the new pod reads the
  claim too);
* snapshots on, in an emptyDir (the default): the rollout that moves them there (the new
  pod's store is empty: it fetches every pool from the old pod), a scale-up 1 -> 2 (the new
  replica fetches from the first);
* snapshots off: the rollout that turns them off, the pod deleted, a scale-up 1 -> 2 (each
  new pod prefills every pool).

    python -m bench.k8s_restore [--reps 1]     # four prefills of every pool a repetition
    python -m bench.k8s_restore --quick        # smoke run: short pools, no files
    python -m bench.k8s_restore --from-json bench/results/k8s_restore.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from polykv_operator.manifests import admin_key
from polykv_testenv import ControlPlane, ProcessNode
from polykv_testenv.claims import bind_claim
from polykv_testenv.operator import OperatorProcess
from polykv_testenv.waiting import wait_for

from . import harness as H
from . import report as R
from .workload import word_text

NAME = "k8s_restore"
NS = "bench"
ENGINE = "eng"
CLAIM = "snapshots"
MASTER = "bench-master-key"
GROUP = f"/apis/polykv.io/v1alpha1/namespaces/{NS}"
PODS = f"/api/v1/namespaces/{NS}/pods"
EXAMPLE_POOLS = H.REPO_ROOT / "examples" / "pools.yaml"


@dataclass(frozen=True)
class Step:
    name: str
    snapshots: str  # "claim", "emptyDir" or "off": the engine's store during the step
    what: str


# In the order they run; each leaves one pod behind for the next.
STEPS = (
    Step("apply", "claim", "first apply, nothing to restore"),
    Step("delete_claim", "claim", "pod deleted"),
    Step("rollout_claim", "claim", "rollout (pod label)"),
    Step("rollout_to_emptydir", "emptyDir", "rollout (claim -> emptyDir)"),
    Step("scale_emptydir", "emptyDir", "scale-up 1 -> 2"),
    Step("rollout_to_off", "off", "rollout (snapshots turned off)"),
    Step("delete_off", "off", "pod deleted"),
    Step("scale_off", "off", "scale-up 1 -> 2"),
)

# The table: (event, the step with snapshots off, the step with snapshots on).
ROWS = (
    ("`kubectl delete pod`, snapshots in a claim", "delete_off", "delete_claim"),
    ("rollout, snapshots in a claim", "rollout_to_off", "rollout_claim"),
    ("rollout, snapshots in an emptyDir", "rollout_to_off", "rollout_to_emptydir"),
    ("scale-up 1 → 2, snapshots in an emptyDir", "scale_off", "scale_emptydir"),
)


@dataclass
class Config:
    reps: int = 1
    model: str = "smollm2-135m-instruct-q4_1"
    long_pools: tuple[int, ...] = (2000, 8000)  # words of filler; about a token each
    context_size: int = 16384
    parallel: int = 4  # the example engine's flags, but a context the long pools fit in
    threads: int = 2
    poll_interval_s: float = 5.0  # the operator's shipped default
    step_timeout_s: float = 2400.0  # an 8k prefill took ~9 minutes on the loaded machine


# ------------------------------------------------------------------------ manifests


def engine_manifest(cfg: Config) -> dict[str, Any]:
    path = f"/models/{cfg.model}.gguf"
    return {
        "apiVersion": "polykv.io/v1alpha1",
        "kind": "PolyKVEngine",
        "metadata": {"name": ENGINE, "namespace": NS},
        "spec": {
            "model": {
                "path": path,
                "init": {"command": ["polykv-fetch-model", cfg.model, "--dest", "/models"]},
            },
            "replicas": 1,
            "parallel": cfg.parallel,
            "contextSize": cfg.context_size,
            "maxPools": 8,
            "threads": cfg.threads,
            "snapshots": {"volume": {"persistentVolumeClaim": {"claimName": CLAIM}}},
        },
    }


def pool_manifests(cfg: Config) -> list[dict[str, Any]]:
    """The example tree, on this engine, and the long pools (roots of their own)."""
    pools = [p for p in yaml.safe_load_all(EXAMPLE_POOLS.read_text()) if p]
    for p in pools:
        p["metadata"]["namespace"] = NS
        p["spec"]["engineRef"] = {"name": ENGINE}
    for n in cfg.long_pools:
        text = f"Reference notes every agent of the team reads first. {word_text(f'k8s/{n}', n)}"
        pools.append(
            {
                "apiVersion": "polykv.io/v1alpha1",
                "kind": "PolyKVPool",
                "metadata": {"name": f"notes-{n}", "namespace": NS},
                "spec": {"engineRef": {"name": ENGINE}, "text": text},
            }
        )
    return pools


# ------------------------------------------------------------------------ the cluster


def conditions(obj: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions") or []}


def tally(sources: dict[str, str | None]) -> str:
    """Pools by how they came to be, e.g. "store 5" or "peer 4, prefill 1"."""
    counts = Counter(str(s) for s in sources.values())
    return ", ".join(f"{src} {n}" for src, n in sorted(counts.items()))


class Bench:
    def __init__(self, cluster: ControlPlane, cfg: Config) -> None:
        self.cluster, self.cfg, self.api = cluster, cfg, cluster.api
        self.pool_names = [p["metadata"]["name"] for p in pool_manifests(cfg)]

    def kubectl(self, *args: str) -> None:
        self.cluster.kubectl(*args, "-n", NS)

    def patch(self, spec: dict[str, Any]) -> None:
        self.kubectl("patch", f"polykvengine/{ENGINE}", "--type=merge", "-p", json.dumps(spec))

    def apply_all(self) -> None:
        objs = (engine_manifest(self.cfg), *pool_manifests(self.cfg))
        self.cluster.apply("\n---\n".join(json.dumps(o) for o in objs))

    def delete_pod(self) -> None:
        (pod,) = self.pods()
        self.kubectl("delete", "pod", pod["metadata"]["name"], "--wait=false")

    def scale(self, n: int) -> None:
        self.kubectl("scale", f"polykvengine/{ENGINE}", f"--replicas={n}")

    def pods(self) -> list[dict[str, Any]]:
        """The engine's pods, terminating ones included."""
        items: list[dict[str, Any]] = self.api.get(
            PODS, labelSelector=f"polykv.io/engine={ENGINE}"
        )["items"]
        return items

    def lone_pod(self) -> dict[str, Any] | None:
        pods = self.pods()
        if len(pods) == 1 and conditions(pods[0]).get("Ready") == "True":
            return pods[0]
        return None

    def settle(self) -> dict[str, Any]:
        """Until one pod is left, Ready (a rollout's old pod or a scale-down's gone)."""
        pod: dict[str, Any] = wait_for("one engine pod, Ready", self.lone_pod, 300)
        return pod

    def written(self, pod: dict[str, Any]) -> None:
        """Until the pod's store holds every pool's snapshot (its writer thread is done)."""
        uid = self.api.get(f"{GROUP}/polykvengines/{ENGINE}")["metadata"]["uid"]
        headers = {"Authorization": f"Bearer {admin_key(MASTER, NS, ENGINE, uid)}"}
        url = f"http://{pod['status']['podIP']}:8080/polykv/pools"

        def probe() -> bool | None:
            snaps = httpx.get(url, headers=headers, timeout=10).json()["snapshots"] or {}
            return True if snaps.get("files", 0) >= len(self.pool_names) else None

        wait_for("every pool's snapshot written", probe, 600)

    def sources(self, pod: str) -> dict[str, str | None]:
        """What each pool's status says about how its cells came to be on ``pod``."""

        def probe() -> dict[str, str | None] | None:
            out = {}
            for name in self.pool_names:
                rows = self.api.get(f"{GROUP}/polykvpools/{name}")["status"].get("replicas")
                row = next((r for r in rows or [] if r["pod"] == pod), None)
                if row is None or row.get("materializedFrom") is None:
                    return None
                out[name] = row["materializedFrom"]
            return out

        found: dict[str, str | None] = wait_for(f"pool statuses on {pod}", probe, 120)
        return found

    def prefix_lengths(self) -> dict[str, int]:
        return {
            n: int(self.api.get(f"{GROUP}/polykvpools/{n}")["status"]["prefixLen"])
            for n in self.pool_names
        }

    def timed(self, step: Step, action: Callable[[], None]) -> dict[str, Any]:
        """Run ``action``; the seconds until a new pod's containers were ready (the engine
        up, its model loaded) and until it was Ready (the gate: every pool there)."""
        before = {p["metadata"]["name"] for p in self.pods()}
        up: dict[str, float] = {}
        deadline = time.monotonic() + self.cfg.step_timeout_s
        with H.TreeCpuWatch() as cpu:
            t0 = time.monotonic()
            action()
            ready: tuple[str, float] | None = None
            while ready is None:
                if time.monotonic() > deadline:
                    raise H.BenchError(f"{step.name}: no new pod Ready in time")
                for p in self.pods():
                    name, conds = p["metadata"]["name"], conditions(p)
                    if name in before:
                        continue
                    if conds.get("ContainersReady") == "True":
                        up.setdefault(name, time.monotonic() - t0)
                    if conds.get("Ready") == "True":
                        ready = name, time.monotonic() - t0
                if ready is None:
                    time.sleep(0.25)
        pod, seconds = ready
        sources = self.sources(pod)
        out = {
            "step": step.name,
            "pod": pod,
            "ready_s": round(seconds, 2),
            "engine_up_s": round(up.get(pod, seconds), 2),
            "sources": sources,
            "own_cores": round(cpu.own_cores, 2),
            "foreign_cores": round(cpu.foreign_cores, 2),
        }
        H.progress(
            f"{step.name}: Ready in {seconds:.1f} s (engine up at {out['engine_up_s']:.1f} s), "
            f"pools: {tally(sources)}; others used {cpu.foreign_cores:.2f} cores"
        )
        return out


def run_steps(b: Bench, cfg: Config) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Every step in turn; each starts from one Ready pod whose store (snapshots on) holds
    every pool."""
    actions: dict[str, Callable[[], None]] = {
        "apply": b.apply_all,
        "delete_claim": b.delete_pod,
        "rollout_claim": lambda: b.patch({"spec": {"podLabels": {"rollout": "claim"}}}),
        "rollout_to_emptydir": lambda: b.patch({"spec": {"snapshots": {"volume": None}}}),
        "scale_emptydir": lambda: b.scale(2),
        "rollout_to_off": lambda: b.patch({"spec": {"snapshots": {"enabled": False}}}),
        "delete_off": b.delete_pod,
        "scale_off": lambda: b.scale(2),
    }
    runs = []
    for step in STEPS:
        runs.append(b.timed(step, actions[step.name]))
        if step.name.startswith("scale"):
            b.scale(1)
        pod_left = b.settle()
        if step.snapshots != "off":
            b.written(pod_left)
    return runs, b.prefix_lengths()


def measure(cfg: Config) -> dict[str, Any]:
    raw: dict[str, Any] = {"env": R.environment(), "runs": []}
    for rep in range(cfg.reps):
        with tempfile.TemporaryDirectory(prefix="polykv-bench-") as tmp:
            root = Path(tmp)
            with (
                ControlPlane(root / "cluster") as cluster,
                ProcessNode(cluster.credentials, root / "node"),
            ):
                cluster.kubectl("apply", "-f", str(H.REPO_ROOT / "crds"))
                for crd in ("polykvengines", "polykvpools", "admissionpolicies"):
                    cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}.polykv.io")
                cluster.kubectl("create", "namespace", NS)
                bind_claim(cluster, NS, CLAIM, "8Gi")
                env = {
                    "POLYKV_OPERATOR_MASTER_KEY": MASTER,
                    "POLYKV_OPERATOR_POLL_INTERVAL": str(cfg.poll_interval_s),
                }
                log = H.RESULTS_DIR / f"{NAME}-operator.log"
                with OperatorProcess(cluster, "polykv_operator.main", NS, log, env):
                    b = Bench(cluster, cfg)
                    steps, lengths = run_steps(b, cfg)
                    cluster.kubectl("delete", "polykvengine", ENGINE, "-n", NS, "--wait=false")
        raw["runs"].append({"rep": rep, "steps": steps})
        raw["prefix_lengths"] = lengths
    return raw


# ------------------------------------------------------------------------ results


def analyse(cfg: Config, raw: dict[str, Any]) -> dict[str, Any]:
    by_step: dict[str, list[dict[str, Any]]] = {s.name: [] for s in STEPS}
    for run in raw["runs"]:
        for s in run["steps"]:
            by_step[s["step"]].append(s)

    def summary(step: str, key: str) -> dict[str, Any]:
        return H.summarize([s[key] for s in by_step[step]]).as_dict()

    def pools_s(s: dict[str, Any]) -> float:
        return float(s["ready_s"] - s["engine_up_s"])

    steps = {
        name: {
            "ready_s": summary(name, "ready_s"),
            "engine_up_s": summary(name, "engine_up_s"),
            "pools_s": H.summarize([pools_s(s) for s in runs]).as_dict(),
            "foreign_cores": summary(name, "foreign_cores"),
            "sources": sorted({tally(s["sources"]) for s in runs}),
        }
        for name, runs in by_step.items()
        if runs
    }
    ratios = {}
    for _, off, on in ROWS:
        pairs = list(zip(by_step[off], by_step[on], strict=True))
        if not pairs:
            continue
        ratios[on] = {
            "ready": H.summarize([a["ready_s"] / b["ready_s"] for a, b in pairs]).as_dict(),
            "pools": H.summarize([pools_s(a) / max(pools_s(b), 0.01) for a, b in pairs]).as_dict(),
        }
    return {"steps": steps, "ratios": ratios}


def render(cfg: Config, raw: dict[str, Any], res: dict[str, Any]) -> str:
    steps, ratios = res["steps"], res["ratios"]
    lengths = raw.get("prefix_lengths") or {}
    longs = " and ".join(f"{lengths.get(f'notes-{n}', n)}" for n in cfg.long_pools)
    tree = ", ".join(str(v) for k, v in lengths.items() if not k.startswith("notes-"))
    reps = "one repetition" if cfg.reps == 1 else f"median (min–max) of {cfg.reps} repetitions"
    headers = [
        "event", "snapshots off: Ready", "on: Ready", "÷", "pools only: off", "on", "÷",
        "on: pools from", "others' cores: off / on",
    ]  # fmt: skip
    rows = []
    for event, off, on in ROWS:
        if on not in steps or off not in steps:
            continue
        a, b = steps[off], steps[on]
        rows.append(
            [
                event,
                R.fmt(a["ready_s"], 1, 1, " s"),
                R.fmt(b["ready_s"], 1, 1, " s"),
                R.fmt(ratios[on]["ready"], 1, 1, "×"),
                R.fmt(a["pools_s"], 1, 1, " s"),
                R.fmt(b["pools_s"], 1, 1, " s"),
                R.fmt(ratios[on]["pools"], 0, 1, "×"),
                " / ".join(b["sources"]),
                f"{R.med(a['foreign_cores'])} / {R.med(b['foreign_cores'])}",
            ]
        )
    first = steps.get("apply")
    foreign = [s["foreign_cores"] for run in raw["runs"] for s in run["steps"]]
    lines = [
        "### Pools after a pod restart, a rollout and a scale-up, on Kubernetes",
        "",
        f"One engine on {cfg.model} (`parallel {cfg.parallel}`, `threads {cfg.threads}`, "
        f"`contextSize {cfg.context_size}`) holding the example tree (pools of {tree} "
        f"tokens) and two long pools ({longs} tokens), on the local control plane (pods as "
        f"processes; the operator at its shipped {cfg.poll_interval_s:g} s poll). *Ready*: "
        "from the kubectl command to the new pod Ready, its readiness gate up (every pool "
        "materialized); *pools only*: from its engine answering /health (model loaded) "
        "to Ready. *Off*: `snapshots.enabled: false`, every pool prefilled; *on*: restored "
        "from the pod's store (`store`) or fetched from the Ready replica (`peer`), as each "
        "pool's status (`materializedFrom`) says. Both columns come from one run, one "
        "engine stepping through all of them (snapshots on first, then off); the rollout "
        "rows of the *off* column share one measurement. Seconds are of "
        f"{reps}; *others' cores*: what other processes used of the machine's cores "
        "meanwhile (the control plane, operator and engines are this run's own).",
        "",
        R.markdown_table(headers, rows),
        "",
    ]
    if first is not None:
        lines += [
            "The first apply (a new engine and its pools, nothing to restore) took "
            f"{R.fmt(first['ready_s'], 1, 1, ' s')}, of which "
            f"{R.fmt(first['pools_s'], 1, 1, ' s')} for the pools.",
            "",
        ]
    lines.append(R.provenance(NAME, raw["env"], foreign))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m bench.{NAME}", description=__doc__)
    p.add_argument("--reps", type=int, default=Config.reps)
    R.add_output_flags(p)
    args = p.parse_args(argv)
    if (rc := R.from_json(NAME, args, Config, analyse, render)) is not None:
        return rc
    cfg = Config(reps=args.reps)
    if args.quick:
        cfg.long_pools, cfg.context_size, cfg.step_timeout_s = (200, 400), 4096, 600.0
    return R.run_and_publish(NAME, cfg, args, measure, analyse, render)


if __name__ == "__main__":
    sys.exit(main())
