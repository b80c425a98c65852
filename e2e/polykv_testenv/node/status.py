"""The pod status a kubelet would write, computed from the container runners (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..kubeapi import Obj
from .container import ContainerRunner, now_iso


def _condition(
    ctype: str, ok: bool, existing: dict[str, Obj], reason: str = "", message: str = ""
) -> Obj:
    status = "True" if ok else "False"
    old = existing.get(ctype)
    # lastTransitionTime moves only when the status flips.
    when = old["lastTransitionTime"] if old and old.get("status") == status else now_iso()
    cond: dict[str, Any] = {
        "type": ctype,
        "status": status,
        "lastTransitionTime": when,
        "lastProbeTime": None,
    }
    if not ok and reason:
        cond["reason"] = reason
        if message:
            cond["message"] = message
    return cond


def _gates(pod: Obj, existing: dict[str, Obj]) -> tuple[bool, str]:
    """Every spec.readinessGates condition must exist and be True."""
    for gate in pod["spec"].get("readinessGates") or []:
        ctype = gate["conditionType"]
        cond = existing.get(ctype)
        if cond is None:
            return False, f'corresponding condition of pod readiness gate "{ctype}" does not exist.'
        if cond.get("status") != "True":
            return (
                False,
                f'the status of pod readiness gate "{ctype}" is not "True", '
                f"but {cond.get('status')}",
            )
    return True, ""


def phase(init: Sequence[ContainerRunner], main: Sequence[ContainerRunner]) -> str:
    for c in init:
        if c.finished and not c.succeeded:
            return "Failed"
        if not (c.finished and c.succeeded):
            return "Pending"
    if main and all(c.finished for c in main):
        # OnFailure restarts failed containers, so they are never finished there.
        return "Succeeded" if all(c.succeeded for c in main) else "Failed"
    if any(c.running or c.ever_started for c in main):
        return "Running"
    return "Pending"


def pod_status(
    pod: Obj,
    init: Sequence[ContainerRunner],
    main: Sequence[ContainerRunner],
    pod_ip: str,
    host_ip: str,
    start_time: str,
    written: dict[str, Obj] | None = None,
) -> Obj:
    """`written`: the conditions this node wrote last, newer than the pod's copy may be."""
    existing = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    existing.update(written or {})
    ph = phase(init, main)
    initialized = all(c.finished and c.succeeded for c in init)
    unready = [c.name for c in main if not c.ready]
    pending_init = [c.name for c in init if not c.finished]
    containers_ready = initialized and not unready
    gates_ok, gate_msg = _gates(pod, existing)

    if ph in ("Succeeded", "Failed"):
        ready_reason, ready_msg = "PodCompleted", ""
    elif not containers_ready:
        ready_reason = "ContainersNotReady"
        ready_msg = f"containers with unready status: [{' '.join(unready)}]"
    else:
        ready_reason, ready_msg = "ReadinessGatesNotReady", gate_msg

    conditions = [
        _condition("PodReadyToStartContainers", bool(pod_ip), existing),
        _condition(
            "Initialized",
            initialized,
            existing,
            "ContainersNotInitialized",
            f"containers with incomplete status: [{' '.join(pending_init)}]",
        ),
        _condition(
            "ContainersReady",
            containers_ready,
            existing,
            "ContainersNotReady",
            f"containers with unready status: [{' '.join(unready)}]",
        ),
        _condition(
            "Ready",
            containers_ready and gates_ok and ph == "Running",
            existing,
            ready_reason,
            ready_msg,
        ),
    ]
    status: dict[str, Any] = {
        "phase": ph,
        "conditions": conditions,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "startTime": start_time,
        "containerStatuses": [c.status() for c in main],
    }
    generation = pod["metadata"].get("generation")
    if generation is not None:
        # As the kubelet does since PodObservedGenerationTracking (beta in 1.34).
        status["observedGeneration"] = generation
        for cond in conditions:
            cond["observedGeneration"] = generation
    if pod_ip:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    if init:
        status["initContainerStatuses"] = [c.status() for c in init]
    return status
