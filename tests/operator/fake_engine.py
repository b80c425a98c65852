"""An in-memory stand-in for an engine replica's pool API, served through httpx.MockTransport.

Tokens are the prompt's characters (or the messages' contents joined), so tests can reason
about prefix lengths and branch positions by counting characters; a `tokens` body is taken
as it is, like the engine does. Refusals are the engine's own error body (`ErrorBody`, so a
reason code the wire contract lacks cannot be written) with the engine's status and reason;
`reasons=False` plays an engine older than the codes. The keys are checked like the engine's
auth: mutating routes need the admin key (an inference key gets 403), the listing needs a
key when the engine has an inference key. tests/operator/test_fake_engine_contract.py
replays the fake's scenarios against a real engine, so the two cannot drift apart.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from polykv_api.models import (
    AdmissionPolicy,
    CapacitySummary,
    ErrorBody,
    ErrorDetail,
    PoolCreated,
    PoolList,
    PoolSession,
    PoolSource,
    PoolStatus,
    Reason,
    SnapshotStoreStatus,
)

WARMING_TPS = 500.0  # what a just-started session's first tokens may look like
TYPES = {400: "exceed_context_size_error", 404: "not_found_error", 409: "conflict_error"}


def tokens_of(body: dict[str, Any]) -> list[int]:
    if body.get("tokens") is not None:
        return list(body["tokens"])
    if body.get("prompt") is not None:
        return [ord(c) for c in body["prompt"]]
    text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
    if body.get("tools"):
        text = f"[{len(body['tools'])} tools]" + text
    return [ord(c) for c in text]


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def summary(
    can_admit: bool = True,
    reason: str = "ok",
    headroom_sessions: int = 3,
    settling: bool = False,
    compaction_pressure: float = 0.25,
) -> CapacitySummary:
    """A pool's capacity summary as the engine lists it (an idle pool by default)."""
    return CapacitySummary(
        can_admit=can_admit,
        reason=reason,
        headroom_sessions=headroom_sessions,
        settling=settling,
        compaction_pressure=compaction_pressure,
    )


@dataclass
class FakePool:
    pool_id: int
    name: str
    parent: str | None
    tokens: list[int]
    branch_pos: int
    admission: AdmissionPolicy | None = None
    capacity: CapacitySummary | None = field(default_factory=summary)  # None: an older engine
    rates: list[float] = field(default_factory=list)  # tps of each active decoding session
    warming: int = 0  # decoding sessions whose rate the engine has not measured yet
    evicted: bool = False  # KV dropped, kept by name (re-materialized on use)
    pinned: bool = False
    last_access_ts: float = 0.0
    source: PoolSource = "prefill"  # how its cells came to be (a restore_peer: "peer")

    def sessions(self) -> list[PoolSession]:
        """Active sessions at their rates; warming ones with a wild first-tokens rate that
        the engine leaves out of its sums (a consumer that averaged tps_ewma would not)."""
        rates = [*self.rates, *[WARMING_TPS] * self.warming]
        return [
            PoolSession(
                session_id=f"{self.name}-{i}",
                slot=i,
                shared_prefix_tokens=len(self.tokens),
                suffix_n_tokens=1,
                marginal_kv_bytes=8,
                tps_ewma=tps,
                state="decoding",
            )
            for i, tps in enumerate(rates)
        ]

    def status(self) -> PoolStatus:
        n, total = len(self.rates), sum(self.rates)
        return PoolStatus(
            pool_id=self.pool_id,
            name=self.name,
            parent=None,
            parent_name=self.parent,
            branch_pos=self.branch_pos,
            prefix_len=len(self.tokens),
            prefix_hash=f"{hash(tuple(self.tokens)) & 0xFFFFFFFF:08x}",
            own_kv_bytes=(len(self.tokens) - self.branch_pos) * 8,
            subtree_kv_bytes=len(self.tokens) * 8,
            residency="evicted" if self.evicted else "resident",
            materialized_from=self.source,
            pinned=self.pinned,
            pinned_explicit=self.pinned,
            orphaned_pin=self.pinned and not self.rates,
            created_ts=0.0,
            last_access_ts=self.last_access_ts,
            depth=0,
            path=self.name,
            children=[],
            sessions=self.sessions(),
            seq_id=self.pool_id,
            n_active=n,
            n_warming=self.warming,
            active_tps_sum=total,
            mean_active_tps=total / n if n else 0.0,
            admission=self.admission,
            capacity=self.capacity,
        )


@dataclass
class FakeEngine:
    boot_id: str = "boot-1"
    max_pools: int = 8
    n_ctx: int = 4096
    pools: dict[str, FakePool] = field(default_factory=dict)
    down: bool = False  # answer nothing (connection refused)
    reasons: bool = True  # send reason codes in error bodies (False: an older engine)
    busy: Reason | None = None  # refuse creates with 503 and this code (kv_full, queue_full)
    calls: list[str] = field(default_factory=list)
    next_id: int = 1
    refused: int = 0  # distinct sessions refused in the last minute (autoscaling)
    headroom: int = 3  # more sessions free slots and KV would take
    unpooled: int = 0  # sessions holding KV outside any pool
    etags: bool = True  # answer If-None-Match with 304 like the engine (False: an older one)
    not_modified: int = 0  # listings answered 304
    admin_key: str | None = "k"  # what the operator's tests hold (EngineState.admin_key)
    peers: list[tuple[str, str | None]] = field(default_factory=list)  # (pool, restore_peer)
    snapshot_bytes: int = 1000  # what its snapshot store holds
    api_key: str | None = None  # an inference key: the listing then needs a key too

    def restart(self, boot_id: str) -> None:
        self.boot_id, self.pools, self.next_id = boot_id, {}, 1

    # -- HTTP ------------------------------------------------------------------------

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path, method = request.url.path, request.method
        self.calls.append(f"{method} {path}")
        refused = self._auth(request)
        if refused is not None:
            return refused
        body = json.loads(request.content) if request.content else {}
        parts = path.strip("/").split("/")  # polykv pools [ref] [verb]
        if path == "/polykv/pools" and method == "GET":
            return self._revalidated(request)
        if path == "/polykv/pools" and method == "POST":
            return self._create(body, None)
        ref = parts[2] if len(parts) > 2 else ""
        verb = parts[3] if len(parts) > 3 else ""
        if verb == "fork":
            return self._create(body, ref)
        if ref not in self.pools:
            return self._error(404, "pool_not_found", f"pool {ref!r} does not exist")
        pool = self.pools[ref]
        if verb == "" and method == "DELETE":
            if any(p.parent == ref for p in self.pools.values()):
                return self._error(409, "has_children", f"pool {ref!r} has child pools")
            del self.pools[ref]
            return self._json(200, {"released": pool.pool_id, "boot_id": self.boot_id})
        if verb == "evict" and method == "POST":
            if pool.pinned:
                return self._error(409, "pool_pinned", f"pool {ref!r} is pinned")
            if any(p.parent == ref and not p.evicted for p in self.pools.values()):
                return self._error(409, "pool_in_use", f"pool {ref!r} has resident children")
            pool.evicted = True
            return self._json(200, pool.status().model_dump())
        if verb == "admission":
            pool.admission = AdmissionPolicy.model_validate(body) if method == "POST" else None
            return self._json(200, pool.status().model_dump())
        return self._error(405, "method_not_allowed", f"unsupported {method} {path}")

    def listing(self) -> PoolList:
        rates = [r for p in self.pools.values() for r in p.rates]
        return PoolList(
            boot_id=self.boot_id,
            pools=[p.status() for p in self.pools.values()],
            tree_depth=1,
            seq_ids_used=len(self.resident()),
            seq_ids_max=self.max_pools,
            kv_cells_used=0,
            kv_cells_total=self.n_ctx,
            kv_bytes_per_token=8,
            kv_bytes_used=0,
            n_active=len(rates),
            n_warming=sum(p.warming for p in self.pools.values()),
            active_tps_sum=sum(rates),
            mean_active_tps=sum(rates) / len(rates) if rates else 0.0,
            unpooled_sessions=[
                PoolSession(
                    session_id=f"unpooled-{i}",
                    slot=100 + i,
                    shared_prefix_tokens=0,
                    suffix_n_tokens=1,
                    marginal_kv_bytes=8,
                    tps_ewma=0.0,
                    state="idle",
                )
                for i in range(self.unpooled)
            ],
            sessions_active=len(rates) + sum(p.warming for p in self.pools.values()),
            sessions_refused=self.refused,
            sessions_headroom=self.headroom,
            snapshots=SnapshotStoreStatus(
                used_bytes=self.snapshot_bytes,
                max_bytes=1 << 30,
                files=len(self.pools),
                bytes_written=0,
                bytes_read=0,
                refusals=0,
            ),
        )

    def resident(self) -> list[FakePool]:
        return [p for p in self.pools.values() if not p.evicted]

    def _create(self, body: dict[str, Any], parent_ref: str | None) -> httpx.Response:
        tokens = tokens_of(body)
        if len(tokens) >= self.n_ctx:
            return self._error(400, "prefix_too_long", "prompt too long")
        name = body["name"]
        parent = self.pools.get(parent_ref) if parent_ref else None
        if parent_ref and parent is None:
            return self._error(404, "pool_not_found", f"pool {parent_ref!r} does not exist")
        existing = self.pools.get(name)
        if existing is not None:
            if existing.tokens != tokens:
                return self._error(409, "name_conflict", f"pool {name!r} has another prefix")
            return self._created(existing, created=False, status=200)
        d = 0
        if parent is not None:
            shared = lcp(parent.tokens, tokens)
            d = body.get("branch_pos") or shared
            if d > len(parent.tokens):
                return self._error(409, "branch_pos_invalid", f"D={d} is past the parent's end")
            if d == 0:
                return self._error(409, "no_common_prefix", "nothing in common with the parent")
        pool = FakePool(self.next_id, name, parent_ref, tokens, d, pinned=bool(body.get("pin")))
        if body.get("restore_peer"):
            pool.source = "peer"
        if body.get("dry_run"):
            return self._json(
                200,
                PoolCreated(
                    created=False,
                    dry_run=True,
                    prefix_len=len(tokens),
                    branch_pos=d,
                    prefix_hash=pool.status().prefix_hash,
                    boot_id=self.boot_id,
                ).model_dump(),
            )
        if self.busy is not None:
            return self._error(503, self.busy, f"engine busy: {self.busy}")
        if len(self.resident()) >= self.max_pools:
            return self._error(409, "seq_ids_exhausted", "no free pool sequence id: all in use")
        self.next_id += 1
        self.pools[name] = pool
        self.peers.append((name, body.get("restore_peer")))
        return self._created(pool, created=True, status=201)

    def _created(self, pool: FakePool, created: bool, status: int) -> httpx.Response:
        st = pool.status()
        out = PoolCreated(
            created=created,
            pool=st,
            pool_id=st.pool_id,
            prefix_len=st.prefix_len,
            branch_pos=st.branch_pos,
            prefix_hash=st.prefix_hash,
            boot_id=self.boot_id,
        )
        return self._json(status, out.model_dump())

    def _revalidated(self, request: httpx.Request) -> httpx.Response:
        body = self.listing().model_dump_json().encode()
        if not self.etags:
            return httpx.Response(200, content=body)
        etag = f'"{hashlib.sha256(body).hexdigest()[:16]}"'
        if request.headers.get("If-None-Match") == etag:
            self.not_modified += 1
            return httpx.Response(304, headers={"ETag": etag})
        return httpx.Response(200, content=body, headers={"ETag": etag})

    @staticmethod
    def _json(status: int, body: Any) -> httpx.Response:
        return httpx.Response(status, json=body)

    def _auth(self, request: httpx.Request) -> httpx.Response | None:
        """The engine's auth (polykv_engine.http.auth): None when the request may go on."""
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        key = key or request.headers.get("X-Api-Key")
        admins = [k for k in (self.admin_key,) if k]
        if self.api_key and key not in [self.api_key, *admins]:
            return self._error(401, "unauthorized", "Invalid API Key", "authentication_error")
        if request.method == "GET" or not admins or key in admins:
            return None
        if self.api_key and key == self.api_key:
            msg = "this key may run inference but not manage pools; use the admin key"
            return self._error(403, "forbidden", msg, "permission_error")
        return self._error(401, "unauthorized", "Invalid API Key", "authentication_error")

    def _error(
        self, status: int, reason: Reason, message: str, etype: str | None = None
    ) -> httpx.Response:
        detail = ErrorDetail(
            code=status,
            message=message,
            type=etype or TYPES.get(status, "invalid_request_error"),
            reason=reason,
        )
        body = ErrorBody(error=detail).model_dump()
        if not self.reasons:
            del body["error"]["reason"]
        return httpx.Response(status, json=body)


class FakeFleet:
    """Several fake replicas behind one transport, addressed by IP."""

    def __init__(self, engines: dict[str, FakeEngine]) -> None:
        self.engines = engines  # ip -> engine

    def transport(self) -> httpx.MockTransport:
        def route(request: httpx.Request) -> httpx.Response:
            return self.engines[request.url.host](request)

        return httpx.MockTransport(route)
