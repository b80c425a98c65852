"""PolyKVEngine: a fleet of engine replicas serving one model."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .meta import CONDITIONS_SCHEMA_EXTRA, Condition, KubeModel, SecretKeySelector

DEFAULT_IMAGE = "polykv/engine:0.1.0"
DEFAULT_ROUTER_IMAGE = "polykv/router:0.1.0"
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: slots + pools (+1 for the KV debug probe)

SPEC_RULES = [
    {
        "rule": f"self.parallel + self.maxPools + 1 <= {MAX_SEQUENCES}",
        "message": f"parallel + maxPools + 1 must be at most {MAX_SEQUENCES}: llama.cpp has "
        f"{MAX_SEQUENCES} sequence ids, one per slot, one per resident pool and one spare; an "
        "engine asked for more would not start. Lower maxPools (cold pools are evicted and "
        "re-materialized on use) or parallel",
        "reason": "FieldValueInvalid",
        "fieldPath": ".maxPools",
    }
]


class ModelInit(KubeModel):
    """An init container that puts the model file on the volume before the engine starts
    (a download on a real cluster, or the generator for a test model)."""

    image: str | None = None
    """Container image; defaults to the engine's image."""
    command: list[str] = Field(min_length=1)
    """The command that writes the model file to spec.model.path."""


class ModelSource(KubeModel):
    """Where the engine finds its GGUF model."""

    path: str = Field(min_length=1, pattern=r"^/")
    """Absolute path of the GGUF file inside the engine container."""
    volume: dict[str, Any] | None = None
    """A Kubernetes volume source holding the model, e.g. {persistentVolumeClaim: {claimName:
    models}}. Absent: an emptyDir (filled by init)."""
    mount_path: str | None = Field(None, pattern=r"^/")
    """Where the volume is mounted; defaults to the directory of path."""
    init: ModelInit | None = None
    """Optional init container that writes the model to the volume first."""


MAX_SNAPSHOT_MIB = 1 << 24  # the engine's own bound on --polykv-snapshot-mib (16 TiB)


class SnapshotSpec(KubeModel):
    """Where each replica keeps its pools' KV snapshots, so that a restarted, rolled or new
    replica restores its pools instead of prefilling them."""

    enabled: bool = True
    """Keep snapshots; false: every replica prefills every pool after a restart."""
    size_mib: int = Field(4096, ge=1, le=MAX_SNAPSHOT_MIB)
    """The most each replica keeps (--polykv-snapshot-mib), least recently used first out;
    an emptyDir gets twice this as its sizeLimit (a file on its way in is counted once it
    is whole)."""
    sessions_mib: int = Field(1024, ge=0, le=MAX_SNAPSHOT_MIB)
    """Sessions' KV caches written at shutdown, within the store (--polykv-session-save-mib;
    0: none): a session's next turn on a replica that reads this volume restores its
    context. An emptyDir keeps them across a container restart; a claim across a rollout."""
    volume: dict[str, Any] | None = None
    """A Kubernetes volume source for the snapshots, e.g. {persistentVolumeClaim: {claimName:
    polykv-snapshots}}: a claim outlives the pod (a pod deleted or rolled restores from it),
    and a ReadWriteMany claim is shared by every replica. Absent: an emptyDir, which a
    container restart keeps; a new pod starts empty and fetches from a Ready peer."""
    from_peers: bool = True
    """A replica whose own store lacks a pool's snapshot fetches it from a replica that
    holds the pool (the operator names one in each create); false: it prefills instead."""


class RouterSpec(KubeModel):
    """polykv-router in front of the replicas: keeps each agent session (x-session-id) on the
    replica that holds its KV, and places new sessions by each replica's admission capacity.
    Clients then use the Service <engine>-router instead of <engine>."""

    enabled: bool = False
    """Deploy the router (a Deployment, a Service and a ServiceAccount allowed to watch this
    namespace's pods, all owned by the engine); false removes them."""
    replicas: int = Field(1, ge=0, le=64)
    """Router replicas. They share no state: each finds a session it does not know by asking
    the engine replicas, so any router can serve any request."""
    image: str = DEFAULT_ROUTER_IMAGE
    """The router container image."""
    port: int = Field(8080, ge=1, le=65535)
    """The router's HTTP port (in the pod and on its Service)."""
    session_ttl_seconds: int = Field(3600, ge=60)
    """A router forgets a session idle for this long (the engine still holds it, and a later
    turn finds it there again)."""
    poll_interval_ms: int = Field(500, ge=100, le=10_000)
    """How often each router asks every replica for its capacity in the pools in use."""
    resources: dict[str, Any] | None = None
    """Container resources (requests/limits), as in a Pod spec."""


class PolyKVEngineSpec(KubeModel):
    """The desired engine fleet. The operator turns it into a Deployment and a Service."""

    model: ModelSource
    """The GGUF model every replica loads."""
    image: str = DEFAULT_IMAGE
    """The engine container image."""
    replicas: int = Field(1, ge=0)
    """Number of engine replicas; the scale subresource (kubectl scale, an HPA) sets it."""
    parallel: int = Field(4, ge=1, le=256)
    """Decoding slots per replica: concurrent sessions (-np)."""
    context_size: int = Field(8192, ge=256)
    """KV cache size in tokens (-c)."""
    max_pools: int = Field(16, ge=1, le=MAX_SEQUENCES - 2)
    """Sequence ids reserved for pools (--polykv-max-pools). llama.cpp has at most 256
    sequence ids: parallel + maxPools + 1 must not exceed 256. A tree with more pools than
    this still fits: cold pools are evicted (kept by name) and re-materialized on use."""
    threads: int | None = Field(None, ge=1)
    """CPU threads for decoding (-t); absent: the cores the pod may use (the physical cores of
    its CPU set, capped by its CPU limit, read by the engine from its cgroup)."""
    port: int = Field(8080, ge=1, le=65535)
    """The engine's HTTP port inside the pod."""
    api_key_secret_ref: SecretKeySelector | None = None
    """Inference API key (--api-key) read from this Secret key; absent: the operator
    generates one into the Secret `<engine>-polykv-api-key` (key `api-key`). An engine never
    serves inference without a key."""
    extra_args: list[str] | None = None
    """More polykv-engine flags (llama-server style), appended as given."""
    resources: dict[str, Any] | None = None
    """Container resources (requests/limits), as in a Pod spec."""
    pod_labels: dict[str, str] | None = None
    """Extra labels for the engine pods."""
    router: RouterSpec | None = None
    """A session-affine, capacity-aware router in front of the replicas (off when absent)."""
    snapshots: SnapshotSpec = Field(default_factory=SnapshotSpec)
    """Pools' KV snapshots (on by default, in an emptyDir)."""


class SnapshotTotals(KubeModel):
    """The fleet's pools by how their cells came to be, and its snapshot stores."""

    restored: int = 0
    """Declared pools, counted per replica, restored from a snapshot (own store or a peer)."""
    rebuilt: int = 0
    """Declared pools, counted per replica, computed by prefill."""
    bytes: int = 0
    """Bytes in the replicas' snapshot stores, summed."""


class ReplicaStatus(KubeModel):
    """One engine replica (pod) as the operator last saw it."""

    pod: str
    """The pod's name."""
    pod_ip: str | None = Field(None, alias="podIP")
    """The pod's IP address."""
    boot_id: str | None = None
    """The engine process's boot id; it changes when the process restarts."""
    pools_ready: bool = False
    """Whether every declared pool and policy is on this replica (its readiness gate)."""
    reachable: bool = False
    """Whether the last poll got an answer."""
    seq_ids_used: int | None = None
    """Sequence ids in use (slots and pools)."""
    seq_ids_max: int | None = None
    """Sequence ids available."""
    kv_cells_used: int | None = None
    """KV cells in use."""
    kv_cells_total: int | None = None
    """KV cells in the cache."""
    sessions: int | None = None
    """Sessions attached to pools."""
    mean_active_tps: float | None = None
    """Mean experienced decode tokens/s of this replica's decoding sessions."""
    pools_evicted: int | None = None
    """Declared pools evicted to fit maxPools: kept by name, re-materialized on first use."""
    unmanaged_pools: int | None = None
    """Pools on the replica that no PolyKVPool declares (made by agents through the engine
    API)."""
    orphaned_pins: list[str] | None = None
    """Undeclared pools pinned with no sessions and no children: KV nobody will release
    (a name, or #pool_id for an unnamed one)."""
    pools_restored: int | None = None
    """Declared pools whose cells this replica restored from a snapshot (its own, a peer's)."""
    pools_rebuilt: int | None = None
    """Declared pools whose cells this replica computed (prefill)."""
    snapshot_bytes: int | None = None
    """Bytes in this replica's snapshot store."""
    message: str | None = None
    """Why the replica is not in service, when it is not."""


class PolyKVEngineStatus(KubeModel):
    """What the operator observed of the fleet."""

    observed_generation: int | None = None
    """The metadata.generation the status was computed from."""
    conditions: list[Condition] | None = Field(None, json_schema_extra=CONDITIONS_SCHEMA_EXTRA)
    """Ready, Reconciling and Stalled (kstatus)."""
    replicas: int | None = None
    """Engine pods that exist."""
    ready_replicas: int | None = None
    """Engine pods that are Ready (engine up, pools materialized)."""
    selector: str | None = None
    """Label selector of the pods, for the scale subresource."""
    pools: int | None = None
    """Declared pools that are materialized everywhere."""
    mean_active_tps: float | None = None
    """Mean experienced decode tokens/s over the fleet's decoding sessions."""
    replica_status: list[ReplicaStatus] | None = None
    """Per replica: boot id, sequence ids and KV cells."""
    snapshots: SnapshotTotals | None = None
    """Pools restored from snapshots and rebuilt by prefill, over the replicas."""
