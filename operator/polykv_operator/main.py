"""kopf entry points, and nothing else: each handler turns what kopf hands over into the
operator's own types (a guard refuses what does not parse), makes one call into the module
that owns the use case, and writes the result back through kopf.

Run it with `kopf run -m polykv_operator.main` (or `polykv-operator`). Who writes what:

- PolyKVEngine: create/update/resume apply its Secret, Deployment and Service; its timer
  runs one round (engine_round.run_round: poll each replica once, materialize, push
  policies, gates) and is the only writer of the engine's status.
- PolyKVPool: create/resume link it to its parent (tree.parent_owner_reference); its timer
  is the only writer of its status while it lives; the delete handler (finalizer,
  pool_release.finalize_pool) releases it on every replica, children first, and writes its
  status while it goes.
- AdmissionPolicy: its timer writes its status; the engine rounds push it to the engines.
- Pods of an engine: an event handler drops the readiness gate the moment an engine stops
  or restarts (engine_round.drop_stale_gate); the engine round raises it again.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import kopf

from . import manifests, metrics
from . import status as stat
from .api import (
    ADMISSION,
    ENGINE,
    GROUP,
    POOL,
    VERSION,
    AdmissionPolicySpec,
    PolyKVEngineSpec,
    PolyKVPoolSpec,
)
from .config import Config
from .engine_round import ClusterView, GateWriter, drop_stale_gate, run_round
from .fleet import EngineState, Fleet, ReplicaRef
from .kube import Kube
from .names import ENGINE_LABEL, FINALIZER, PREFIX
from .policies import PolicyNode, select
from .pool_release import Holder, finalize_pool
from .tree import PoolNode, parent_owner_reference

log = logging.getLogger("polykv.operator")

CONFIG = Config.from_env()
FLEET = Fleet()


class Clients:
    """The clients: one for the engines, one for our own API writes (kopf's credentials)."""

    def __init__(self) -> None:
        self.connection: Any = None  # a kopf.ConnectionInfo, set by the login handler
        self.http: httpx.AsyncClient | None = None
        self.kube: Kube | None = None

    def engine_http(self) -> httpx.AsyncClient:
        if self.http is None:
            self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=64))
        return self.http

    def kube_client(self) -> Kube:
        if self.kube is None:
            if self.connection is None:
                raise kopf.TemporaryError("not logged in to the API server yet", delay=1)
            self.kube = Kube.from_connection(self.connection)
        return self.kube

    def gate_writer(self, namespace: str) -> GateWriter:
        """Sets a pod's readiness gate in `namespace` (engine_round decides which and how)."""
        return functools.partial(self.kube_client().set_gate, namespace)


CLIENTS = Clients()


# ------------------------------------------------------------------------ operator setup


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    CONFIG.require_master_key()  # fail fast: engines cannot be administered without it
    # One finalizer for everything: pools need it to release their KV on the engines, and
    # kopf puts it on every object with a timer so that the timer stops before it goes.
    settings.persistence.finalizer = FINALIZER
    # Handler progress and the last-handled spec live in annotations: the status schema is
    # strict and would prune status.kopf (and status belongs to our own writers).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    # Kubernetes Events for warnings and errors only: timers would flood the stream.
    settings.posting.level = logging.WARNING
    # Watches restart every few minutes even when the server keeps them open.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # A replica's state is polled by our timers; a watch stall must not hide for long.
    settings.watching.inactivity_timeout = 600
    settings.execution.max_workers = 4  # no sync handlers do heavy work
    # Timers succeed every interval on every object; their success is not news.
    logging.getLogger("kopf.objects").addFilter(_QuietTimers())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call is noise
    if CONFIG.metrics_port is not None:
        metrics.REGISTRY.register(metrics.FleetCollector(lambda: metrics.figures(FLEET)))
        metrics.REGISTRY.register(metrics.PoolCollector(metrics.POOLS.rows))
        metrics.serve(CONFIG.metrics_port, CONFIG.metrics_address)
    log.info(
        "operator configured poll_interval_s=%s metrics_port=%s",
        CONFIG.poll_interval_s,
        CONFIG.metrics_port,
    )


class _QuietTimers(logging.Filter):
    """Drops the per-interval "succeeded" lines of timers and of the pod event handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        routine = msg.startswith("Timer ") or msg.startswith("Handler 'engine_pod_event'")
        return not (routine and msg.endswith(" succeeded."))


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # The same credentials for kopf and for our own writes (kube.py).
    info = kopf.login_via_client(**kwargs)
    CLIENTS.connection = info
    CLIENTS.kube = None
    return info


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if CLIENTS.http is not None:
        await CLIENTS.http.aclose()
    if CLIENTS.kube is not None:
        await CLIENTS.kube.close()


def _counted(kind: str, handler: str) -> Callable[[Callable[..., Awaitable[Any]]], Any]:
    """Counts a handler's outcomes in polykv_operator_reconcile_total."""

    def wrap(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        # wraps(): kopf derives the handler id (and its progress annotation) from the name.
        @functools.wraps(fn)
        async def run(**kwargs: Any) -> Any:
            try:
                out = await fn(**kwargs)
            except kopf.TemporaryError:
                metrics.RECONCILES.labels(kind, handler, "retry").inc()
                raise
            except kopf.PermanentError:
                metrics.RECONCILES.labels(kind, handler, "permanent").inc()
                raise
            except Exception:
                metrics.RECONCILES.labels(kind, handler, "error").inc()
                raise
            metrics.RECONCILES.labels(kind, handler, "ok").inc()
            return out

        return run

    return wrap


# ------------------------------------------------------------------------------- indexes


@dataclass(frozen=True)
class EngineEntry:
    """A PolyKVEngine as the operator indexes it."""

    name: str
    uid: str
    spec: PolyKVEngineSpec
    generation: int


@kopf.index(GROUP, VERSION, ENGINE.plural)
def engines_idx(
    namespace: str | None, name: str, uid: str, spec: kopf.Spec, meta: kopf.Meta, **_: Any
) -> dict[str, EngineEntry] | None:
    try:
        parsed = PolyKVEngineSpec.model_validate(dict(spec))
    except ValueError:
        return None
    return {str(namespace): EngineEntry(name, uid, parsed, int(meta.get("generation") or 1))}


@kopf.index(GROUP, VERSION, POOL.plural)
def pools_idx(
    namespace: str | None, name: str, uid: str, spec: kopf.Spec, meta: kopf.Meta, **_: Any
) -> dict[str, PoolNode] | None:
    try:
        parsed = PolyKVPoolSpec.model_validate(dict(spec))
        parsed.source()
    except ValueError:
        return None
    node = PoolNode(
        namespace=str(namespace),
        name=name,
        uid=uid,
        spec=parsed,
        labels=dict(meta.get("labels") or {}),
        generation=int(meta.get("generation") or 1),
        deleting=bool(meta.get("deletionTimestamp")),
    )
    return {node.namespace: node}


@kopf.index(GROUP, VERSION, ADMISSION.plural)
def policies_idx(
    namespace: str | None, name: str, uid: str, spec: kopf.Spec, meta: kopf.Meta, **_: Any
) -> dict[str, PolicyNode] | None:
    try:
        parsed = AdmissionPolicySpec.model_validate(dict(spec))
    except ValueError:
        return None
    ns = str(namespace)
    return {ns: PolicyNode(ns, name, uid, parsed, int(meta.get("generation") or 1))}


@kopf.index("pods", labels={ENGINE_LABEL: kopf.PRESENT})
def pods_idx(
    namespace: str | None, body: kopf.Body, labels: kopf.Labels, **_: Any
) -> dict[tuple[str, str], ReplicaRef]:
    return {(str(namespace), labels[ENGINE_LABEL]): ReplicaRef.from_pod(body)}


def _ns(index: kopf.Index[Any, Any], key: Any) -> list[Any]:
    return list(index.get(key, []))


# ------------------------------------------------------------------------------- engines


def _engine_state(namespace: str, name: str, uid: str) -> EngineState:
    state = FLEET.get(namespace, name)
    state.admin_key = manifests.admin_key(CONFIG.master_key, namespace, name, uid)
    return state


@kopf.on.resume(GROUP, VERSION, ENGINE.plural)
@kopf.on.create(GROUP, VERSION, ENGINE.plural)
@kopf.on.update(GROUP, VERSION, ENGINE.plural, field="spec")
@_counted("engine", "apply")
async def apply_engine(
    body: kopf.Body, name: str, namespace: str, uid: str, spec: kopf.Spec, logger: Any, **_: Any
) -> None:
    """Secret (admin key), Deployment and Service, owned by the engine; with
    spec.router.enabled, the router's objects too (removed again when it is turned off)."""
    try:
        parsed = PolyKVEngineSpec.model_validate(dict(spec))
    except ValueError as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    state = _engine_state(namespace, name, uid)
    assert state.admin_key is not None
    objs = [
        manifests.admin_secret(name, state.admin_key),
        manifests.deployment(name, parsed),
        manifests.service(name, parsed),
    ]
    routed = parsed.router is not None and parsed.router.enabled
    if routed:
        objs += manifests.router_objects(name, namespace, parsed)
    kopf.adopt(objs, owner=body)
    kube = CLIENTS.kube_client()
    for obj in objs:
        # Secrets are merge-patched: the operator may not read them, only write them.
        what = await kube.apply(namespace, obj, strategic=obj["kind"] != "Secret")
        logger.info(f"{obj['kind']} {obj['metadata']['name']} {what}")
    if not routed:
        for api_version, kind in manifests.ROUTER_KINDS:
            router = manifests.router_name(name)
            if await kube.delete(namespace, api_version, kind, router):
                logger.info(f"{kind} {router} deleted (spec.router is off)")


@kopf.on.delete(GROUP, VERSION, ENGINE.plural, optional=True)
def forget_engine(name: str, namespace: str | None, **_: Any) -> None:
    FLEET.forget(str(namespace), name)


@kopf.timer(GROUP, VERSION, ENGINE.plural, interval=CONFIG.poll_interval_s)
@_counted("engine", "round")
async def engine_round(
    name: str,
    namespace: str,
    uid: str,
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    patch: kopf.Patch,
    engines_idx: kopf.Index[str, EngineEntry],
    pools_idx: kopf.Index[str, PoolNode],
    policies_idx: kopf.Index[str, PolicyNode],
    pods_idx: kopf.Index[tuple[str, str], ReplicaRef],
    **_: Any,
) -> None:
    """One round (engine_round.run_round); then the engine's status if it changed."""
    parsed = PolyKVEngineSpec.model_validate(dict(spec))
    view = ClusterView(
        namespace=namespace,
        name=name,
        spec=parsed,
        pods=_ns(pods_idx, (namespace, name)),
        pools=_ns(pools_idx, namespace),
        policies=_ns(policies_idx, namespace),
        engines=[e.name for e in _ns(engines_idx, namespace)],
    )
    state = _engine_state(namespace, name, uid)
    gates = CLIENTS.gate_writer(namespace)
    generation = int(meta.get("generation") or 1)
    patch.status.update(
        await run_round(view, state, CLIENTS.engine_http(), gates, generation, status)
    )


# --------------------------------------------------------------------------------- pools


def _pool_context(
    namespace: str,
    engines_idx: kopf.Index[str, EngineEntry],
    pools_idx: kopf.Index[str, PoolNode],
    policies_idx: kopf.Index[str, PolicyNode],
) -> stat.PoolContext:
    pools = _ns(pools_idx, namespace)
    engines = [e.name for e in _ns(engines_idx, namespace)]
    fleet = {e: s for e in engines if (s := FLEET.peek(namespace, e)) is not None}
    selection = select(_ns(policies_idx, namespace), {n.name: dict(n.labels) for n in pools})
    return stat.PoolContext(
        pools={n.name: n for n in pools}, engines=engines, fleet=fleet, selection=selection
    )


def _me(namespace: str, name: str, pools_idx: kopf.Index[str, PoolNode]) -> PoolNode:
    for node in _ns(pools_idx, namespace):
        if node.name == name:
            assert isinstance(node, PoolNode)
            return node
    # The index lags the event by a moment, or the spec does not parse (CEL prevents that).
    raise kopf.TemporaryError(f"pool {namespace}/{name} is not indexed yet", delay=1)


@kopf.on.resume(GROUP, VERSION, POOL.plural)
@kopf.on.create(GROUP, VERSION, POOL.plural)
@_counted("pool", "link")
async def link_parent(
    body: kopf.Body,
    name: str,
    namespace: str,
    spec: kopf.Spec,
    patch: kopf.Patch,
    pools_idx: kopf.Index[str, PoolNode],
    **_: Any,
) -> None:
    """A child pool is owned by its parent: deleting a root removes the tree (and tools that
    follow ownerReferences show it). Waits for a missing parent; refuses a cycle."""
    parent = spec.get("parent")
    if not parent:
        return
    if parent == name:
        raise kopf.PermanentError("a pool cannot be its own parent")
    found = next((n for n in _ns(pools_idx, namespace) if n.name == parent), None)
    if found is None:
        # The status says ParentNotFound meanwhile; a parent applied later is picked up.
        raise kopf.TemporaryError(f'parent "{parent}" does not exist yet', delay=3)
    refs = list(body.meta.get("ownerReferences") or [])
    if not any(r.get("uid") == found.uid for r in refs):
        patch.metadata["ownerReferences"] = [*refs, parent_owner_reference(found)]


@kopf.timer(GROUP, VERSION, POOL.plural, interval=CONFIG.poll_interval_s)
@_counted("pool", "status")
async def pool_status(
    name: str,
    namespace: str,
    status: kopf.Status,
    patch: kopf.Patch,
    engines_idx: kopf.Index[str, EngineEntry],
    pools_idx: kopf.Index[str, PoolNode],
    policies_idx: kopf.Index[str, PolicyNode],
    **_: Any,
) -> None:
    """The pool's status from the last engine round (no engine calls here)."""
    node = _me(namespace, name, pools_idx)
    ctx = _pool_context(namespace, engines_idx, pools_idx, policies_idx)
    new = stat.pool_status(node, ctx, stat.previous_conditions(status))
    patch.status.update(stat.patch_for(status, new))
    metrics.POOLS.record(
        metrics.PoolFigures(
            namespace,
            name,
            node.engine,
            {c.type: c.status for c in new.conditions or []},
            bool(new.orphaned_pin),
        )
    )


@kopf.on.delete(GROUP, VERSION, POOL.plural)
@_counted("pool", "release")
async def release_pool(
    name: str,
    namespace: str,
    uid: str,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    engines_idx: kopf.Index[str, EngineEntry],
    pools_idx: kopf.Index[str, PoolNode],
    pods_idx: kopf.Index[tuple[str, str], ReplicaRef],
    **_: Any,
) -> None:
    """Children first, then this pool on every replica (pool_release.finalize_pool). An
    unreachable replica keeps the finalizer."""
    engine = str((spec.get("engineRef") or {}).get("name", ""))
    entry = next((e for e in _ns(engines_idx, namespace) if e.name == engine), None)
    holder = None
    if entry is not None:
        state = _engine_state(namespace, engine, entry.uid)
        holder = Holder(state, _ns(pods_idx, (namespace, engine)), entry.spec.port)
    waiting = await finalize_pool(
        namespace,
        name,
        uid,
        _ns(pools_idx, namespace),
        holder,
        CLIENTS.engine_http(),
        CLIENTS.kube_client(),
        status,
    )
    if waiting is not None:
        patch.status.update(waiting.status_patch)
        raise kopf.TemporaryError(waiting.message, delay=waiting.delay)
    metrics.POOLS.forget(namespace, name)


# ---------------------------------------------------------------------------- policies


@kopf.timer(GROUP, VERSION, ADMISSION.plural, interval=CONFIG.poll_interval_s)
@_counted("admissionpolicy", "status")
async def policy_status(
    name: str,
    namespace: str,
    status: kopf.Status,
    patch: kopf.Patch,
    engines_idx: kopf.Index[str, EngineEntry],
    pools_idx: kopf.Index[str, PoolNode],
    policies_idx: kopf.Index[str, PolicyNode],
    **_: Any,
) -> None:
    """Where the policy is in effect (the engine rounds do the pushing)."""
    me = next((p for p in _ns(policies_idx, namespace) if p.name == name), None)
    if me is None:
        raise kopf.TemporaryError(f"policy {namespace}/{name} is not indexed yet", delay=1)
    ctx = _pool_context(namespace, engines_idx, pools_idx, policies_idx)
    new = stat.policy_status(
        me, ctx.selection, ctx.pools, ctx.fleet, stat.previous_conditions(status)
    )
    patch.status.update(stat.patch_for(status, new))


# -------------------------------------------------------------------------------- pods


@kopf.on.event("pods", labels={ENGINE_LABEL: kopf.PRESENT})
async def engine_pod_event(
    namespace: str | None, body: kopf.Body, labels: kopf.Labels, **_: Any
) -> None:
    """Drops the readiness gate as soon as an engine stops or restarts: its KV is gone, and
    the Service must not route to it until the next round re-materializes the tree."""
    state = FLEET.peek(str(namespace), labels.get(ENGINE_LABEL, ""))
    if state is None or namespace is None:
        return
    await drop_stale_gate(state, ReplicaRef.from_pod(body), CLIENTS.gate_writer(namespace))
