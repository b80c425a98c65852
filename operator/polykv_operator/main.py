"""kopf entry points, and nothing else: each handler turns what kopf hands over into the
operator's own types (a guard refuses what does not parse), makes one call into the module
that owns the use case, and writes the result back through kopf.

Run it with `kopf run -m polykv_operator.main` (or `polykv-operator`). Who writes what:

- PolyKVEngine: create/update/resume apply its Secret, Deployment and Service; its daemon
  (engine_loop.serve) runs the engine's rounds: poll each replica once, materialize, push
  policies, gates, then write the engine's status and its live pools' statuses (their only
  writer while they live). A round runs at once when poked, else every poll interval.
- PolyKVPool: create/resume link it to its parent (tree.parent_owner_reference) and poke
  its engine; the delete handler (finalizer, pool_release.finalize_pool) releases it on
  every replica, children first, and writes its status while it goes. No per-pool timer.
- AdmissionPolicy: its timer writes its status; any event of one pokes the namespace's
  engines, whose rounds push it.
- Pods of an engine: an event handler drops the readiness gate the moment an engine stops
  or restarts (engine_round.drop_stale_gate) and pokes the engine when a replica comes or
  goes; the engine round raises the gate again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx
import kopf

from polykv_api import tracing

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
from .autoscale.aggregate import Signal, engine_signal
from .autoscale.metrics_api import ExternalSettings, Servers
from .config import Config
from .engine_client import engine_http
from .engine_loop import Snapshot, StatusWriter, serve, write_pool_statuses
from .engine_objects import apply_objects
from .engine_round import ClusterView, CostWriter, GateWriter, drop_stale_gate
from .faults import crash_point
from .fleet import EngineState, Fleet, ReplicaRef, controller_uid, replica_changed
from .kube import Kube
from .names import ENGINE_LABEL, FINALIZER, PREFIX
from .policies import PolicyNode, select
from .pool_release import Holder, finalize_pool
from .replicas import owned_by
from .tree import PoolNode, parent_owner_reference

log = logging.getLogger("polykv.operator")

CONFIG = Config.from_env()
FLEET = Fleet()
CLASH_RETRY_S = 15  # a name held by a foreign object: looked at again this often


class Clients:
    """The clients: one for the engines, one for our own API writes (kopf's credentials)."""

    def __init__(self) -> None:
        self.connection: Any = None  # a kopf.ConnectionInfo, set by the login handler
        self.http: httpx.AsyncClient | None = None
        self.kube: Kube | None = None

    def engine_http(self) -> httpx.AsyncClient:
        if self.http is None:
            self.http = engine_http()
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

    def cost_writer(self, namespace: str) -> CostWriter:
        """Sets a pod's pod-deletion-cost annotation in `namespace`."""
        return functools.partial(self.kube_client().set_deletion_cost, namespace)

    def status_writer(self, namespace: str) -> StatusWriter:
        """Merge-patches the status of one of our objects in `namespace`."""
        return functools.partial(self.kube_client().patch_status, namespace)


CLIENTS = Clients()
SERVERS = Servers()


# ------------------------------------------------------------------------ operator setup


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    CONFIG.check()  # fail fast: no master key, or autoscaling settings that cannot work
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
    # Each engine round as a span, when an OTLP endpoint is configured (OTEL_EXPORTER_OTLP_*).
    if tracing.setup("polykv-operator"):
        logging.getLogger("polykv.operator").info("tracing on: rounds go to the OTLP endpoint")
    # A timer or daemon being stopped (its object deleting) is checked on this often; kopf's
    # 60 s default held a finalizer for a minute whenever one was mid-call.
    settings.background.cancellation_polling = 0.5
    # Peering (`--peering polykv`, not --standalone): the live operator with the highest
    # priority acts, the others wait; each replica draws its own so that two never tie (a
    # tie pauses both). A SIGKILLed leader is presumed dead after `lifetime` seconds.
    if CONFIG.priority is not None:
        settings.peering.priority = CONFIG.priority
    elif settings.peering.priority == 0:
        settings.peering.priority = random.randrange(1, 2**31)
    settings.peering.lifetime = CONFIG.peering_lifetime_s
    # Timers succeed every interval on every object; their success is not news.
    logging.getLogger("kopf.objects").addFilter(_QuietTimers())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call is noise
    if CONFIG.metrics_port is not None:
        metrics.REGISTRY.register(metrics.FleetCollector(lambda: metrics.figures(FLEET)))
        metrics.REGISTRY.register(metrics.PoolCollector(metrics.POOLS.rows))
        metrics.serve(CONFIG.metrics_port, CONFIG.metrics_address)
    log.info(
        "operator configured poll_interval_s=%s metrics_port=%s peering_priority=%s",
        CONFIG.poll_interval_s,
        CONFIG.metrics_port,
        settings.peering.priority,
    )


class _QuietTimers(logging.Filter):
    """Drops the per-interval "succeeded" lines of timers and of the pod event handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        routine = msg.startswith("Timer ") or msg.startswith("Handler 'engine_pod_event'")
        routine = routine or msg.startswith("Handler 'policy_event'")
        return not (routine and msg.endswith(" succeeded."))


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # The same credentials for kopf and for our own writes (kube.py).
    info = kopf.login_via_client(**kwargs)
    CLIENTS.connection = info
    CLIENTS.kube = None
    return info


def _signal(namespace: str, engine: str) -> Signal | None:
    state = FLEET.peek(namespace, engine)
    return None if state is None else engine_signal(state, time.time())


async def _logged_in() -> Any:
    """The API client once the login handler has run (kopf logs in after startup)."""
    while CLIENTS.connection is None:
        await asyncio.sleep(0.2)
    return CLIENTS.kube_client()


@kopf.on.startup()
async def autoscale_servers(**_: Any) -> None:
    """The autoscaling JSON now; the external metrics API once logged in (it reads the
    front-proxy CA and the APIService first), in the background."""
    if CONFIG.autoscale_port is not None:
        await SERVERS.start_json(_signal, CONFIG.metrics_address, CONFIG.autoscale_port)
    if CONFIG.external_metrics_port is not None:
        assert CONFIG.external_metrics_cert and CONFIG.external_metrics_key  # CONFIG.check()
        ns, name = CONFIG.external_metrics_service.split("/", 1)
        settings = ExternalSettings(
            CONFIG.metrics_address,
            CONFIG.external_metrics_port,
            CONFIG.external_metrics_cert,
            CONFIG.external_metrics_key,
            ns,
            name,
            CONFIG.external_metrics_ca,
        )

        async def external() -> None:
            kube = await _logged_in()
            await SERVERS.start_external(_signal, settings, kube.get, kube.set_ca_bundle)

        SERVERS.task = asyncio.create_task(external())


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    await SERVERS.stop()
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
    namespace: str | None,
    name: str,
    uid: str,
    spec: kopf.Spec,
    meta: kopf.Meta,
    status: kopf.Status,
    **_: Any,
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
        status=dict(status),
        resource_version=str(meta.get("resourceVersion") or ""),
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
    """Pods by the engine they claim (a label): `_replicas` keeps the engine's own."""
    return {(str(namespace), labels[ENGINE_LABEL]): ReplicaRef.from_pod(body)}


@kopf.index("apps", "v1", "replicasets", labels={ENGINE_LABEL: kopf.PRESENT})
def replicasets_idx(
    namespace: str | None, uid: str, meta: kopf.Meta, **_: Any
) -> dict[tuple[str, str], str] | None:
    """A ReplicaSet's uid -> the uid of the Deployment that controls it."""
    owner = controller_uid(meta, "Deployment", "apps/v1")
    return {(str(namespace), uid): owner} if owner else None


@kopf.index("apps", "v1", "deployments", labels={ENGINE_LABEL: kopf.PRESENT})
def deployments_idx(
    namespace: str | None, uid: str, meta: kopf.Meta, **_: Any
) -> dict[tuple[str, str], str] | None:
    """A Deployment's uid -> the uid of the PolyKVEngine that controls it."""
    owner = controller_uid(meta, ENGINE.kind, f"{GROUP}/{VERSION}")
    return {(str(namespace), uid): owner} if owner else None


def _replicas(
    namespace: str,
    engine_uid: str,
    pods: list[ReplicaRef],
    replicasets_idx: kopf.Index[tuple[str, str], str],
    deployments_idx: kopf.Index[tuple[str, str], str],
) -> list[ReplicaRef]:
    """Those of `pods` (labelled for the engine) that the engine owns (replicas.owned_by)."""

    def owner(index: kopf.Index[tuple[str, str], str]) -> Callable[[str], str | None]:
        return lambda uid: next(iter(index.get((namespace, uid), [])), None)

    return owned_by(pods, engine_uid, owner(replicasets_idx), owner(deployments_idx))


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
    """Secrets (admin key, generated API key), NetworkPolicy, Deployment and Service, owned
    by the engine; with spec.router.enabled, the router's objects too (removed again when
    it is turned off). A name some other object holds stalls the engine and writes nothing
    (engine_objects)."""
    try:
        parsed = PolyKVEngineSpec.model_validate(dict(spec))
    except ValueError as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    state = _engine_state(namespace, name, uid)
    assert state.admin_key is not None

    def key(purpose: str) -> str:
        return manifests.derived_key(CONFIG.master_key, purpose, namespace, name, uid)

    # Without apiKeySecretRef the engine still needs a key: the operator's own, derived.
    generated = [] if parsed.api_key_secret_ref else [manifests.api_key_secret(name, key("api"))]
    secrets = [manifests.admin_secret(name, state.admin_key, key("router")), *generated]
    own = manifests.engine_objects(name, parsed, secrets, CONFIG.network_policy)
    routed = parsed.router is not None and parsed.router.enabled
    router = (
        manifests.router_objects(
            name, namespace, parsed, CONFIG.router_cluster_role, CONFIG.network_policy
        )
        if routed
        else None
    )
    kopf.adopt(own + (router or []), owner=body)
    clash = await apply_objects(CLIENTS.kube_client(), namespace, name, uid, own, router)
    if state.clash != (clash.message if clash else None):
        state.clash = clash.message if clash else None
        state.poke()  # the engine's status says Stalled (or no longer) at once
    if clash is not None:
        logger.warning(clash.message)
        raise kopf.TemporaryError(clash.message, delay=CLASH_RETRY_S)


@kopf.on.delete(GROUP, VERSION, ENGINE.plural, optional=True)
@_counted("engine", "forget")
async def forget_engine(
    name: str,
    namespace: str | None,
    spec: kopf.Spec,
    engines_idx: kopf.Index[str, EngineEntry],
    pools_idx: kopf.Index[str, PoolNode],
    policies_idx: kopf.Index[str, PolicyNode],
    **_: Any,
) -> None:
    """The engine's pools say EngineNotFound (no loop writes them any more)."""
    namespace = str(namespace)
    state = FLEET.peek(namespace, name)
    FLEET.forget(namespace, name)
    try:
        parsed = PolyKVEngineSpec.model_validate(dict(spec))
    except ValueError:
        return
    view = _view(namespace, name, parsed, engines_idx, pools_idx, policies_idx, [])
    view = replace(view, engines=[e for e in view.engines if e != name])
    memo = state if state is not None else EngineState((namespace, name))
    await write_pool_statuses(view, memo, FLEET, CLIENTS.status_writer(namespace))


def _view(
    namespace: str,
    name: str,
    spec: PolyKVEngineSpec,
    engines_idx: kopf.Index[str, EngineEntry],
    pools_idx: kopf.Index[str, PoolNode],
    policies_idx: kopf.Index[str, PolicyNode],
    pods: list[ReplicaRef],
) -> ClusterView:
    return ClusterView(
        namespace=namespace,
        name=name,
        spec=spec,
        pods=pods,
        pools=_ns(pools_idx, namespace),
        policies=_ns(policies_idx, namespace),
        engines=[e.name for e in _ns(engines_idx, namespace)],
    )


@kopf.daemon(GROUP, VERSION, ENGINE.plural, cancellation_timeout=1.0)
@_counted("engine", "loop")  # its rounds are counted as handler="round" (engine_loop.serve)
async def engine_loop(
    name: str,
    namespace: str | None,
    uid: str,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    engines_idx: kopf.Index[str, EngineEntry],
    pools_idx: kopf.Index[str, PoolNode],
    policies_idx: kopf.Index[str, PolicyNode],
    pods_idx: kopf.Index[tuple[str, str], ReplicaRef],
    replicasets_idx: kopf.Index[tuple[str, str], str],
    deployments_idx: kopf.Index[tuple[str, str], str],
    **_: Any,
) -> None:
    """The engine's rounds (engine_loop.serve) for as long as the engine exists: `body` and
    the indexes are live views, read afresh for each round."""
    ns = str(namespace)

    def snapshot() -> Snapshot:
        changes = FLEET.changes(ns)  # before the view: a change while it is read is seen
        spec = PolyKVEngineSpec.model_validate(dict(body.spec))
        labelled = _ns(pods_idx, (ns, name))
        pods = _replicas(ns, uid, labelled, replicasets_idx, deployments_idx)
        view = _view(ns, name, spec, engines_idx, pools_idx, policies_idx, pods)
        meta = body.meta
        return Snapshot(
            view=view,
            uid=uid,
            generation=int(meta.get("generation") or 1),
            status=dict(body.status),
            resource_version=str(meta.get("resourceVersion") or ""),
            changes=changes,
        )

    await serve(
        _engine_state(ns, name, uid),
        snapshot,
        FLEET,
        CLIENTS.engine_http(),
        CLIENTS.gate_writer(ns),
        CLIENTS.status_writer(ns),
        CONFIG.poll_interval_s,
        lambda: bool(stopped),
        CLIENTS.cost_writer(ns),
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
    status: kopf.Status,
    engines_idx: kopf.Index[str, EngineEntry],
    policies_idx: kopf.Index[str, PolicyNode],
    **_: Any,
) -> None:
    """A child pool is owned by its parent: deleting a root removes the tree (and tools that
    follow ownerReferences show it). Waits for a missing parent; refuses a cycle. Pokes the
    engine, whose next round (now) materializes the pool and writes its status; a pool
    whose engine does not exist gets its status here (no engine loop will write it)."""
    engine = str((spec.get("engineRef") or {}).get("name", ""))
    state = FLEET.peek(namespace, engine)
    if state is not None:
        state.poke()
    elif not status and all(e.name != engine for e in _ns(engines_idx, namespace)):
        # A new pool whose engine does not exist (on resume the engine index may not be
        # filled yet, and a pool already has a status: its engine loop, or the engine's
        # delete handler, wrote it).
        node = _me(namespace, name, pools_idx)
        ctx = _pool_context(namespace, engines_idx, pools_idx, policies_idx)
        new = stat.pool_status(node, ctx, stat.previous_conditions(status))
        patch.status.update(stat.patch_for(status, new))
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
        crash_point("pool-linked")


@kopf.on.update(GROUP, VERSION, POOL.plural, field="metadata.labels")
async def pool_labels(namespace: str | None, spec: kopf.Spec, **_: Any) -> None:
    """Labels pick admission policies: the engine's round re-selects them now."""
    state = FLEET.peek(str(namespace), str((spec.get("engineRef") or {}).get("name", "")))
    if state is not None:
        state.poke()


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
    replicasets_idx: kopf.Index[tuple[str, str], str],
    deployments_idx: kopf.Index[tuple[str, str], str],
    **_: Any,
) -> None:
    """Children first, then this pool on every replica (pool_release.finalize_pool). An
    unreachable replica keeps the finalizer."""
    engine = str((spec.get("engineRef") or {}).get("name", ""))
    entry = next((e for e in _ns(engines_idx, namespace) if e.name == engine), None)
    holder = None
    if entry is not None:
        state = _engine_state(namespace, engine, entry.uid)
        labelled = _ns(pods_idx, (namespace, engine))
        pods = _replicas(namespace, entry.uid, labelled, replicasets_idx, deployments_idx)
        holder = Holder(state, pods, entry.spec.port)
    waiting = await finalize_pool(
        namespace,
        name,
        uid,
        lambda: _ns(pools_idx, namespace),
        holder,
        CLIENTS.engine_http(),
        CLIENTS.kube_client(),
        status,
        FLEET,
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


@kopf.on.event(GROUP, VERSION, ADMISSION.plural)
async def policy_event(namespace: str | None, **_: Any) -> None:
    """A policy applied, edited or deleted: the engines of its namespace push it now."""
    FLEET.touch(str(namespace))
    FLEET.poke_namespace(str(namespace))


@kopf.on.event(GROUP, VERSION, ENGINE.plural)
@kopf.on.event(GROUP, VERSION, POOL.plural)
async def counted_event(namespace: str | None, **_: Any) -> None:
    """Any event, deletions included (which kopf's indexers drop without a call): the
    namespace's engines run a full round at their next interval, not a quiet check. Event
    handlers run after the indexes took the event, so that round reads it."""
    FLEET.touch(str(namespace))


# -------------------------------------------------------------------------------- pods


@kopf.on.event("pods", labels={ENGINE_LABEL: kopf.PRESENT})
async def engine_pod_event(
    namespace: str | None, body: kopf.Body, labels: kopf.Labels, **indexes: Any
) -> None:
    """Drops the readiness gate as soon as an engine stops or restarts: its KV is gone, and
    the Service must not route to it until the next round re-materializes the tree. A
    replica that came, went, turned ready or restarted pokes the engine's round. A pod
    that only carries the label (not the engine's own) is left alone."""
    FLEET.touch(str(namespace))
    engine = labels.get(ENGINE_LABEL, "")
    state = FLEET.peek(str(namespace), engine)
    entries = _ns(indexes["engines_idx"], str(namespace))
    entry = next((e for e in entries if e.name == engine), None)
    if state is None or namespace is None or entry is None:
        return
    pod = ReplicaRef.from_pod(body)
    if not _replicas(
        namespace, entry.uid, [pod], indexes["replicasets_idx"], indexes["deployments_idx"]
    ):
        return
    if replica_changed(state.pods.get(pod.name), pod):
        state.poke()
    await drop_stale_gate(state, pod, CLIENTS.gate_writer(namespace))
