"""Pools on the engine thread: materialization, retention and release.

The tree rules live in ``pools.tree`` (pure); this module applies them to the KV cache. A
pool is materialized by a prefill-only build that rides the normal batch (no logits, no
slot): a fork first shares its parent's cells ``[0, D)`` (``seq_cp``, copy-free), then
prefills ``[D, L)``. Engine thread only; ``pools.listing`` renders the wire view.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from polykv_api.models import PoolRef
from polykv_engine.kv.cache import KVCache
from polykv_engine.llama.runtime import Batch
from polykv_engine.persist.fileformat import KVSnapshot, SnapshotRefused
from polykv_engine.persist.store import SnapshotStore
from polykv_engine.pools import kept, persisted
from polykv_engine.pools.tree import Pool, PoolError, PoolTree, Source

log = logging.getLogger("polykv.pools")


class AttachedSlot(Protocol):
    """What the pool manager reads of a slot (the engine's published slot snapshot)."""

    @property
    def slot_id(self) -> int: ...
    @property
    def session_id(self) -> str | None: ...
    @property
    def state(self) -> Literal["idle", "prefill", "decoding"]: ...
    @property
    def pool_id(self) -> int | None: ...
    @property
    def tps_ewma(self) -> float: ...
    @property
    def warming(self) -> bool: ...
    @property
    def ctx_used(self) -> int: ...
    @property
    def ttft_ms(self) -> float | None: ...


@dataclass(slots=True)
class Build:
    pool: Pool
    rebuild: bool = False  # re-materializing an evicted pool (a failure leaves it evicted)
    started: bool = False
    # A kept prefix's build starts from another kept prefix's cells [0, seed_len) when that
    # one is resident by then (no tree link: either may go first); else it computes them.
    seed: Pool | None = None
    seed_len: int = 0
    batch_tokens: int = 0
    waiters: list[concurrent.futures.Future[None]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A create/fork request with its prefix already turned into tokens (or a session)."""

    tokens: list[int] | None
    from_session: str | None
    name: str | None
    pin: bool
    dry_run: bool
    parent: PoolRef | None = None
    branch_pos: int | None = None
    snapshot: KVSnapshot | None = None  # checked cells for this prefix: restore, not prefill
    snapshot_source: Source = "store"


@dataclass(frozen=True, slots=True)
class CreateResult:
    pool: Pool
    created: bool
    ready: concurrent.futures.Future[None]
    refused: SnapshotRefused | None = None  # the snapshot given, and why it was not used


def _done() -> concurrent.futures.Future[None]:
    fut: concurrent.futures.Future[None] = concurrent.futures.Future()
    fut.set_result(None)
    return fut


def _settle(fut: concurrent.futures.Future[None], error: BaseException | None = None) -> None:
    """Complete a waiter unless its HTTP client already gave up (cancelled it)."""
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


class PoolManager:
    def __init__(
        self,
        kv: KVCache,
        seq_ids: range,
        bytes_per_token: int,
        grace_s: float,
        session_tokens: Callable[[str], tuple[int | None, list[int]] | None],
        state_bytes: int = 0,
        extend_only: bool = False,
        on_removed: Callable[[int], None] = lambda pool_id: None,
        store: SnapshotStore | None = None,
        scratch: int | None = None,
    ) -> None:
        self.kv = kv
        self.tree = PoolTree(seq_ids, extend_only)
        self.bpt = bytes_per_token
        self.state_bytes = state_bytes  # a recurrent state, per sequence that computed tokens
        self.grace_s = grace_s
        self._session_tokens = session_tokens
        self._on_removed = on_removed  # sessions linked to a removed pool are no longer
        self.builds: list[Build] = []
        # Where built pools' cells are saved, and the spare sequence they go through.
        self.store = store if scratch is not None else None
        self.scratch = scratch

    # ------------------------------------------------------------------ create / fork

    def create(self, spec: PoolSpec) -> CreateResult | Pool:
        """Validate, register and start materializing. A dry run returns the planned Pool."""
        parent = self.tree.resolve(spec.parent) if spec.parent is not None else None
        if parent is not None and parent.kept:
            raise PoolError(
                409,
                "not_supported",
                f"pool {parent.label!r} is a kept prefix (a tenant's cache_control "
                "breakpoint), which is never a parent: fork a declared pool",
            )
        tokens, src_slot = self._prefix_tokens(spec)
        existing = self.tree.existing_for(spec.name, tokens, parent)
        if existing is not None:
            existing.last_access_ts = time.time()
            return CreateResult(existing, False, self.ensure_resident(existing))
        if parent is None:
            planned = self.tree.plan_root(tokens, spec.name)
        else:
            planned = self.tree.plan_fork(parent, tokens, spec.branch_pos, spec.name)
        planned.pinned = spec.pin
        if spec.dry_run:
            return planned
        if parent is not None and parent.residency == "evicted":
            self.ensure_resident(parent)  # the child's build waits for the parent's
        self.free_seq_from_kept()
        pool = self.tree.add(planned)
        if src_slot is not None:
            # Snapshot of a live session: its cells already hold [0, L). Share them.
            assert pool.seq_id is not None
            self.kv.share(src_slot, pool.seq_id, 0, pool.prefix_len)
            pool.n_materialized = pool.prefix_len
            pool.source = "session"
            self.tree.set_residency(pool, "resident")
            log.info(
                "pool %s: snapshot of session %s, %d tokens",
                pool.label,
                spec.from_session,
                pool.prefix_len,
            )
            return CreateResult(pool, True, _done())
        refused = None
        if spec.snapshot is not None:
            refused = self._restore(pool, parent, spec.snapshot, spec.snapshot_source)
            if refused is None:
                return CreateResult(pool, True, _done())
        log.info(
            "pool %s: materializing L=%d D=%d parent=%s",
            pool.label,
            pool.prefix_len,
            pool.branch_pos,
            parent.label if parent else None,
        )
        build = Build(pool)
        self.builds.append(build)
        return CreateResult(pool, True, self._waiter(build), refused)

    def _restore(
        self, pool: Pool, parent: Pool | None, snap: KVSnapshot, source: Source
    ) -> SnapshotRefused | None:
        """Materialize ``pool`` from a checked snapshot; the refusal when it could not be
        (the pool's sequence is then empty, and it is built by prefill instead)."""
        assert self.scratch is not None
        t0 = time.perf_counter()
        try:
            persisted.restore(self.kv, self.scratch, pool, parent, snap)
        except SnapshotRefused as exc:
            if self.store is not None:
                self.store.refused(exc.reason)
            log.warning(
                "pool %s: snapshot from %s refused (%s): %s; prefilling",
                pool.label,
                source,
                exc.reason,
                exc.message,
            )
            return exc
        pool.n_materialized = pool.prefix_len
        pool.source = source
        self.tree.set_residency(pool, "resident")
        log.info(
            "pool %s: restored from %s, L=%d D=%d, %.1f MiB in %.3fs",
            pool.label,
            source,
            pool.prefix_len,
            pool.branch_pos,
            snap.payload_bytes / 2**20,
            time.perf_counter() - t0,
        )
        return None

    def _prefix_tokens(self, spec: PoolSpec) -> tuple[list[int], int | None]:
        """The prefix, and the slot whose cells already hold it (None: prefill it)."""
        if spec.tokens is not None:
            return spec.tokens, None
        assert spec.from_session is not None
        found = self._session_tokens(spec.from_session)
        if found is None:
            raise PoolError(
                404,
                "session_not_found",
                f"session {spec.from_session!r} is not known to this engine",
                "not_found_error",
            )
        slot_id, tokens = found
        if not tokens:
            raise PoolError(
                409, "session_empty", f"session {spec.from_session!r} holds no context yet"
            )
        return tokens, slot_id

    def keep(
        self, tokens: list[int], owner: str, ttl_s: float, seed: Pool | None, seed_len: int
    ) -> Pool:
        """A kept prefix (``pools.kept``): a root pool of ``owner``'s, built from ``seed``'s
        cells ``[0, seed_len)`` when it has them by then. PoolError when no sequence id is
        free."""
        pool = self.tree.add(self.tree.plan_root(tokens, None))
        pool.owner = owner
        kept.extend(pool, ttl_s, time.time())
        self.builds.append(Build(pool, seed=seed, seed_len=seed_len if seed is not None else 0))
        return pool

    def free_seq_from_kept(self) -> None:
        """Declared pools come before kept prefixes: when no sequence id is free, the least
        recently used resident kept prefix goes (its sessions keep their cells)."""
        if self.tree.seq_free():
            return
        idle = [p for p in self.tree.pools.values() if p.kept and p.residency == "resident"]
        if idle:
            self.release(min(idle, key=lambda p: p.last_access_ts))

    def _waiter(self, build: Build) -> concurrent.futures.Future[None]:
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        build.waiters.append(fut)
        return fut

    def ensure_resident(self, pool: Pool) -> concurrent.futures.Future[None]:
        """A future that completes when ``pool`` is in KV, re-materializing it if evicted."""
        if pool.residency == "resident":
            return _done()
        for build in self.builds:
            if build.pool is pool:
                return self._waiter(build)
        assert pool.residency == "evicted"
        if pool.parent_id is not None:
            self.ensure_resident(self.tree.pools[pool.parent_id])
        self.free_seq_from_kept()
        self.tree.give_seq(pool)
        self.tree.set_residency(pool, "materializing")
        pool.n_materialized = 0
        log.info("pool %s: re-materializing after eviction", pool.label)
        build = Build(pool, rebuild=True)
        self.builds.append(build)
        return self._waiter(build)

    # ------------------------------------------------------------------ the batch

    def add_to_batch(self, batch: Batch, budget: int) -> int:
        """Add prefill chunks of pending builds (no logits); returns the budget left."""
        for build in self.builds:
            build.batch_tokens = 0
            if budget <= 0:
                continue
            pool = build.pool
            assert pool.seq_id is not None
            if not build.started:
                if pool.parent_id is not None:
                    parent = self.tree.pools[pool.parent_id]
                    if parent.residency != "resident":
                        continue  # wait for the parent's own build
                    assert parent.seq_id is not None
                    self.kv.share(parent.seq_id, pool.seq_id, 0, pool.branch_pos)
                    pool.n_materialized = pool.branch_pos
                elif build.seed is not None and not self._seed(build):
                    continue  # the seed is still materializing
                build.started = True
            n = min(pool.prefix_len - pool.n_materialized, budget)
            if n <= 0:
                continue  # nothing of its own to prefill (L == D): after_decode finishes it
            chunk = pool.tokens[pool.n_materialized : pool.n_materialized + n]
            guard = self.kv.guard_of(pool.seq_id)
            batch.add_span(chunk, pool.n_materialized, pool.seq_id, False, guard)
            build.batch_tokens = n
            budget -= n
        return budget

    def _seed(self, build: Build) -> bool:
        """Share the seed's cells into the build's pool if it is resident; False while it
        is still materializing (a seed that is gone is no seed: all is computed)."""
        seed, pool = build.seed, build.pool
        assert seed is not None and pool.seq_id is not None
        if self.tree.pools.get(seed.pool_id) is not seed:
            return True
        if seed.residency == "materializing":
            return False
        if seed.residency == "resident" and seed.seq_id is not None:
            self.kv.share(seed.seq_id, pool.seq_id, 0, build.seed_len)
            pool.n_materialized = build.seed_len
        return True

    def after_decode(self) -> int:
        """Account decoded chunks; finish builds that are complete. Returns tokens prefilled."""
        total = 0
        for build in list(self.builds):
            pool = build.pool
            if build.batch_tokens:
                assert pool.seq_id is not None
                self.kv.decoded(pool.seq_id, build.batch_tokens)
                pool.n_materialized += build.batch_tokens
                total += build.batch_tokens
                build.batch_tokens = 0
            if build.started and pool.n_materialized == pool.prefix_len:
                self.tree.set_residency(pool, "resident")
                pool.source = "prefill"
                kept.built(pool, time.time())
                self.builds.remove(build)
                log.info("pool %s: resident (%d tokens)", pool.label, pool.prefix_len)
                # A kept prefix is one tenant's prompt, never restored: it stays off disk.
                if self.store is not None and self.scratch is not None and not pool.kept:
                    persisted.save(self.kv, self.scratch, self.store, pool)
                for fut in build.waiters:
                    _settle(fut)
        return total

    def pending_tokens(self) -> int:
        """Prefix tokens the builds still have to compute."""
        return sum(
            b.pool.prefix_len
            - (b.pool.n_materialized if b.started else b.pool.branch_pos + b.seed_len)
            for b in self.builds
        )

    def builds_in_batch(self) -> list[Build]:
        return [b for b in self.builds if b.batch_tokens]

    def fail_build(self, build: Build, error: PoolError) -> None:
        """Abandon a build: the pool is removed entirely, nothing is left half-created."""
        self.builds.remove(build)
        pool = build.pool
        log.warning("pool %s: materialization failed: %s", pool.label, error.message)
        # Children waiting on this build fail with it.
        for child in self.tree.descendants(pool):
            for other in list(self.builds):
                if other.pool is child:
                    self.fail_build(
                        other,
                        PoolError(error.status, "parent_failed", f"parent failed: {error.message}"),
                    )
        if build.rebuild:
            self._evict_now(pool)
        else:
            if pool.seq_id is not None:
                self.kv.clear(pool.seq_id)
            self._remove(pool)
        for fut in build.waiters:
            _settle(fut, error)

    # ------------------------------------------------------------------ retention

    def sessions_of(self, pool: Pool, slots: Sequence[AttachedSlot]) -> list[AttachedSlot]:
        return [s for s in slots if s.pool_id == pool.pool_id]

    def auto_pin_reasons(self, pool: Pool, slots: Sequence[AttachedSlot]) -> list[str]:
        reasons = []
        if self.sessions_of(pool, slots):
            reasons.append("sessions are attached")
        live_kids = [
            self.tree.pools[c].label
            for c in sorted(pool.children)
            if self.tree.pools[c].residency != "evicted"
        ]
        if live_kids:
            reasons.append(f"child pools are resident ({', '.join(live_kids)})")
        return reasons

    def is_pinned(self, pool: Pool, slots: Sequence[AttachedSlot]) -> bool:
        return pool.pinned or bool(self.auto_pin_reasons(pool, slots))

    def pin(self, pool: Pool, on: bool) -> None:
        pool.pinned = on

    def evict(self, pool: Pool, slots: Sequence[AttachedSlot]) -> None:
        """Drop the pool's KV but keep the pool: the next attach or fork re-materializes it."""
        if pool.residency == "materializing":
            raise PoolError(
                409, "pool_materializing", f"pool {pool.label!r} is still materializing"
            )
        if pool.residency == "evicted":
            return
        if pool.pinned:
            raise PoolError(
                409, "pool_pinned", f"pool {pool.label!r} is pinned; unpin it before evicting"
            )
        reasons = self.auto_pin_reasons(pool, slots)
        if reasons:
            raise PoolError(
                409, "pool_in_use", f"pool {pool.label!r} is in use: {'; '.join(reasons)}"
            )
        self._evict_now(pool)

    def _remove(self, pool: Pool) -> None:
        self.tree.remove(pool)
        self._on_removed(pool.pool_id)

    def _evict_now(self, pool: Pool) -> None:
        if pool.seq_id is not None:
            self.kv.clear(pool.seq_id)
        if pool.kept:  # a cache of the tenant's: evicted, it is gone (nothing rebuilds it)
            self._remove(pool)
            log.info("kept prefix %s: released", pool.label)
            return
        self.tree.give_back_seq(pool)
        self.tree.set_residency(pool, "evicted")
        pool.n_materialized = 0
        log.info("pool %s: evicted", pool.label)

    def flush_plan(
        self, pool: Pool, slots: Sequence[AttachedSlot]
    ) -> tuple[list[Pool], list[AttachedSlot]]:
        """Pools (leaves first) and idle sessions a flush of ``pool``'s subtree would drop."""
        subtree = [pool, *self.tree.descendants(pool)]
        pinned = [p.label for p in subtree if p.pinned]
        if pinned:
            raise PoolError(
                409,
                "pool_pinned",
                f"cannot flush: pinned pools in the subtree: {', '.join(pinned)}",
            )
        if any(p.residency == "materializing" for p in subtree):
            raise PoolError(
                409,
                "pool_materializing",
                "cannot flush while a pool in the subtree is materializing",
            )
        ids = {p.pool_id for p in subtree}
        attached = [s for s in slots if s.pool_id in ids]
        busy = [s for s in attached if s.state != "idle"]
        if busy:
            names = ", ".join(str(s.session_id or f"slot {s.slot_id}") for s in busy)
            raise PoolError(
                409, "pool_in_use", f"cannot flush: sessions are running in the subtree: {names}"
            )
        return list(reversed(subtree)), attached

    def flush(self, pools: list[Pool]) -> None:
        for p in pools:
            if p.residency != "evicted":
                self._evict_now(p)

    def release(self, pool: Pool) -> None:
        """Remove the pool. Sessions still holding its cells keep them (refcounted cells)."""
        self.tree.check_removable(pool)
        for build in list(self.builds):
            if build.pool is pool:
                self.fail_build(
                    build, PoolError(409, "pool_released", f"pool {pool.label!r} was released")
                )
                return
        if pool.seq_id is not None:
            self.kv.clear(pool.seq_id)
        self._remove(pool)
        log.info("pool %s: released", pool.label)

    def reclaimable(self, slots: Sequence[AttachedSlot], now: float) -> list[Pool]:
        """Pools the engine may evict under KV pressure: unpinned, unused, past the grace TTL."""
        return sorted(
            (
                p
                for p in self.tree.pools.values()
                if p.residency == "resident"
                and not self.is_pinned(p, slots)
                and now - p.last_access_ts >= self.grace_s
            ),
            key=lambda p: p.last_access_ts,
        )
