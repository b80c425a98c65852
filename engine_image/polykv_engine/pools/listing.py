"""The wire view of the pool tree (``GET /polykv/pools``), rendered on the engine thread.

KV is attributed by ownership, never by membership: a cell shared by many sequences belongs
to the oldest pool holding it (a parent is always older than its forks, so a fork owns only
what it added), else to the lowest-numbered session holding it. So Σ own bytes of every pool
+ Σ marginal bytes of every session == the bytes in use, with nothing counted twice; and one
pool's share is found from its own cells, whatever the number of other pools.

On a recurrent or hybrid model every sequence that computed tokens of its own also holds a
recurrent state of fixed size (one attached at a pool's end shares the pool's until it
decodes): it is counted with that sequence's own bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from polykv_api.models import PoolList, PoolSession, PoolStatus, SnapshotStoreStatus
from polykv_engine.kv.cells import KVModel
from polykv_engine.policy.tps import ActiveRates, active_rates
from polykv_engine.pools.manager import AttachedSlot, PoolManager
from polykv_engine.pools.tree import Pool


def _rates(slots: Sequence[AttachedSlot]) -> ActiveRates:
    return active_rates((s.state == "decoding", s.warming, s.tps_ewma) for s in slots)


class _Attribution:
    """Every cell attributed to one holder (pools oldest first, then sessions), and the
    statuses built on it. ``whole``: count every holder in one pass (the full listing);
    otherwise each status counts its own cells (one pool's answer)."""

    def __init__(self, pools: PoolManager, slots: Sequence[AttachedSlot], whole: bool) -> None:
        self.pools, self.slots = pools, slots
        self.model = pools.kv.model
        by_seq = pools.tree.by_seq

        def rank(seq: int) -> tuple[int, int]:
            pool = by_seq.get(seq)
            return (0, pool.pool_id) if pool is not None else (1, seq)

        self._rank = rank
        self._counts = self.model.owners(rank) if whole else None
        self.slot_seqs = [s.slot_id for s in slots]

    def owned_bytes(self, seq: int | None) -> int:
        if seq is None:
            return 0
        n = self._counts[seq] if self._counts is not None else self.model.owned(seq, self._rank)
        return n * self.pools.bpt + (self.pools.state_bytes if n > 0 else 0)

    @property
    def used_bytes(self) -> int:
        """Every holder's bytes (whole attribution only)."""
        assert self._counts is not None
        holders = sum(1 for n in self._counts.values() if n > 0)
        return self.model.used * self.pools.bpt + holders * self.pools.state_bytes

    @cached_property
    def shared_by_sessions(self) -> set[int]:
        """Cells two or more sessions hold (sharing without a pool), found once for all."""
        return _cells_of_many(self.model, self.slot_seqs)

    def session(self, s: AttachedSlot, pool: Pool | None) -> PoolSession:
        shared = (
            self.model.common_cells(s.slot_id, pool.seq_id)
            if pool is not None and pool.seq_id is not None
            else 0
        )
        return PoolSession(
            session_id=s.session_id,
            slot=s.slot_id,
            shared_prefix_tokens=shared,
            suffix_n_tokens=s.ctx_used - shared,
            marginal_kv_bytes=self.owned_bytes(s.slot_id),
            tps_ewma=s.tps_ewma,
            ttft_ms=s.ttft_ms,
            state=s.state,
            implicit_shared_tokens=self.model.count_in(s.slot_id, self.shared_by_sessions),
        )

    def statuses(self, root: Pool | None) -> list[PoolStatus]:
        """Every pool's status, or only ``root``'s subtree's (root first), parents first."""
        pools, slots, tree = self.pools, self.slots, self.pools.tree
        subject = list(tree.parents_first(root))
        statuses: dict[int, PoolStatus] = {}
        for pool in reversed(subject):  # children before parents
            members = pools.sessions_of(pool, slots)
            attached = [self.session(s, pool) for s in members]
            rates = _rates(members)
            own = self.owned_bytes(pool.seq_id)
            subtree = own + sum(a.marginal_kv_bytes for a in attached)
            subtree += sum(statuses[c].subtree_kv_bytes for c in pool.children)
            parent = tree.pools.get(pool.parent_id) if pool.parent_id is not None else None
            statuses[pool.pool_id] = PoolStatus(
                pool_id=pool.pool_id,
                name=pool.name,
                parent=pool.parent_id,
                parent_name=parent.name if parent else None,
                branch_pos=pool.branch_pos,
                prefix_len=pool.prefix_len,
                prefix_hash=pool.prefix_hash,
                own_kv_bytes=own,
                subtree_kv_bytes=subtree,
                residency=pool.residency,
                materialized_from=pool.source,
                pinned=pools.is_pinned(pool, slots),
                pinned_explicit=pool.pinned,
                orphaned_pin=pool.pinned and not attached and not pool.children,
                created_ts=pool.created_ts,
                last_access_ts=pool.last_access_ts,
                depth=tree.depth(pool),
                path=path_of(pools, pool),
                children=sorted(pool.children),
                sessions=attached,
                seq_id=pool.seq_id,
                n_active=rates.n_active,
                n_warming=rates.n_warming,
                active_tps_sum=rates.tps_sum,
                mean_active_tps=rates.mean,
                admission=pool.admission,
                kept_until=pool.kept_until if pool.kept else None,
            )
        return [statuses[p.pool_id] for p in subject]


def subtree(pools: PoolManager, slots: Sequence[AttachedSlot], root: Pool) -> list[PoolStatus]:
    """``root``'s status, then its descendants': ownership is attributed over every pool,
    but only these statuses are built, so a create or a pin answers in time independent of
    how many other pools there are."""
    return _Attribution(pools, slots, whole=False).statuses(root)


def render(
    pools: PoolManager,
    slots: Sequence[AttachedSlot],
    boot_id: str,
    n_ctx: int,
    measured: int | None,
) -> PoolList:
    """The whole listing: every pool, the sessions outside pools, engine-wide figures."""
    attribution = _Attribution(pools, slots, whole=True)
    ordered = attribution.statuses(None)
    model, tree, bpt = attribution.model, pools.tree, pools.bpt
    unpooled = [
        attribution.session(s, None)
        for s in slots
        if s.pool_id is None and attribution.owned_bytes(s.slot_id) > 0
    ]
    everyone = _rates(slots)
    n_slots = len(slots)
    return PoolList(
        boot_id=boot_id,
        pools=ordered,
        tree_depth=max((s.depth for s in ordered), default=-1) + 1,
        seq_ids_used=n_slots + tree.seq_ids_used,
        seq_ids_max=n_slots + len(tree.seq_ids),
        kv_cells_used=model.used,
        kv_cells_total=n_ctx,
        kv_bytes_per_token=bpt,
        kv_bytes_used=attribution.used_bytes,
        recurrent_state_bytes=pools.state_bytes,
        unpooled_sessions=unpooled,
        implicit_shared_cells=len(attribution.shared_by_sessions),
        kv_cells_measured=measured,
        n_active=everyone.n_active,
        n_warming=everyone.n_warming,
        active_tps_sum=everyone.tps_sum,
        mean_active_tps=everyone.mean,
        snapshots=_store_status(pools),
    )


def _store_status(pools: PoolManager) -> SnapshotStoreStatus | None:
    store = pools.store
    if store is None:
        return None
    st = store.stats_now()
    return SnapshotStoreStatus(
        used_bytes=store.used_bytes,
        max_bytes=store.max_bytes,
        files=store.n_files,
        bytes_written=st.bytes_written,
        bytes_read=sum(st.bytes_read.values()),
        refusals=sum(st.refusals.values()),
    )


def path_of(pools: PoolManager, pool: Pool) -> str:
    """``root/child/grandchild`` by labels."""
    parts = [pool.label]
    while pool.parent_id is not None:
        pool = pools.tree.pools[pool.parent_id]
        parts.append(pool.label)
    return "/".join(reversed(parts))


def _cells_of_many(model: KVModel, seqs: list[int]) -> set[int]:
    """Cells held by two or more of ``seqs`` (sessions sharing without a pool)."""
    seen: set[int] = set()
    many: set[int] = set()
    for seq in seqs:
        for c in set(model.cells(seq)):
            (many if c in seen else seen).add(c)
    return many
