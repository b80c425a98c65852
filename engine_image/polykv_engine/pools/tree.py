"""The pool tree: pools, their contract checks and bookkeeping (pure: no llama_cpp).

A pool is an immutable prefix ``tokens[0:L)``. A root owns all of it; a child shares its
parent's ``[0, D)`` (D = ``branch_pos``) and owns ``[D, L)``: D == parent.L extends the
parent, D < parent.L branches off it. Every rule a request can break is checked here and
raised as a ``PoolError`` carrying the HTTP status, before any KV memory is touched, so a
refused request changes nothing.
"""

from __future__ import annotations

import re
import struct
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import xxhash

from polykv_api.models import POOL_NAME_PATTERN, AdmissionPolicy, PoolRef, Reason
from polykv_engine.ids import decimal
from polykv_engine.tokens import common_prefix_len

Residency = Literal["materializing", "resident", "evicted"]
Source = Literal["prefill", "store", "peer", "session"]

NAME_RE = re.compile(POOL_NAME_PATTERN)
_HASH_SEED = 0x9E3779B97F4A7C15
_PACK = struct.Struct("<QI")


class PoolError(Exception):
    """A refused pool operation: the HTTP ``status``, a stable ``reason`` code for programs,
    and a ``message`` for people. Raised before anything is touched, so it changes nothing."""

    def __init__(self, status: int, reason: Reason, message: str, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason: Reason = reason
        self.message = message
        self.type = type_


def chained_hashes(tokens: Sequence[int], prefix: array | None = None) -> array:  # type: ignore[type-arg]
    """h[i] = xxh64(h[i-1] || token[i]): the hash at i fingerprints the whole prefix [0, i].

    Chaining (instead of one streaming hash) lets a child reuse its parent's hashes up to D
    and lets any position be compared in O(1).
    """
    out = array("Q", prefix if prefix is not None else ())
    h = out[-1] if out else _HASH_SEED
    for tok in tokens[len(out) :]:
        h = xxhash.xxh64_intdigest(_PACK.pack(h, tok))
        out.append(h)
    return out


def validate_name(name: str) -> None:
    if not NAME_RE.fullmatch(name):  # fullmatch: "$" alone lets a trailing "\n" through
        raise PoolError(
            400,
            "name_invalid",
            f"pool name {name!r} is invalid: 1-253 characters of letters, digits, '.', '_', "
            "':' or '-', starting with a letter or digit, and not all digits (those are ids)",
        )


@dataclass(slots=True)
class Pool:
    pool_id: int
    name: str | None
    parent_id: int | None
    branch_pos: int
    tokens: list[int]
    hashes: array  # type: ignore[type-arg]
    seq_id: int | None = None
    residency: Residency = "materializing"
    pinned: bool = False
    children: set[int] = field(default_factory=set)
    created_ts: float = field(default_factory=time.time)
    last_access_ts: float = field(default_factory=time.time)
    n_materialized: int = 0  # positions of the pool's sequence that are in KV
    source: Source = "prefill"  # how its own cells were last materialized
    admission: AdmissionPolicy | None = None
    # A kept prefix (pools.kept): the tenant whose cache_control breakpoint it holds, until
    # when, and for how long past its last request. None: a declared pool, shared by design.
    owner: str | None = None
    kept_until: float = 0.0
    kept_ttl_s: float = 0.0

    @property
    def kept(self) -> bool:
        return self.owner is not None

    @property
    def prefix_len(self) -> int:
        return len(self.tokens)

    @property
    def prefix_hash(self) -> str:
        return f"{self.hashes[-1]:016x}" if self.hashes else "0" * 16

    @property
    def label(self) -> str:
        return self.name or str(self.pool_id)


class PoolTree:
    """All pools of one engine and the sequence ids reserved for them."""

    def __init__(self, seq_ids: range, extend_only: bool = False) -> None:
        self.seq_ids = seq_ids
        # Recurrent and hybrid models: a sequence's state exists only at its end, so a child
        # starts from its parent's whole prefix (D == parent.L) or not at all.
        self.extend_only = extend_only
        self._free_seqs = list(reversed(seq_ids))
        self.pools: dict[int, Pool] = {}
        self.by_seq: dict[int, Pool] = {}  # resident or materializing pools by sequence id
        self._changed: set[int] = set()  # ids of pools added, removed or restated since taken
        self._by_name: dict[str, int] = {}
        self._next_id = 1

    # ------------------------------------------------------------------ lookup

    def resolve(self, ref: PoolRef, tenant: str | None = None) -> Pool:
        """A pool by id (int or all-digit string) or by name; 404 when absent, or when it is
        another tenant's kept prefix and ``tenant`` is the one asking."""
        number = ref if isinstance(ref, int) else decimal(ref)
        if number is not None:
            pool = self.pools.get(number)
        else:
            pid = self._by_name.get(str(ref))
            pool = self.pools.get(pid) if pid is not None else None
        if pool is None or (tenant is not None and pool.kept and pool.owner != tenant):
            raise PoolError(
                404, "pool_not_found", f"pool {ref!r} does not exist", "not_found_error"
            )
        return pool

    def roots(self) -> list[Pool]:
        return [p for p in self.pools.values() if p.parent_id is None]

    def parents_first(self, root: Pool | None = None) -> Iterator[Pool]:
        """Every pool (or ``root``'s subtree, root first), each after its parent (pre-order
        by id)."""
        stack = [root] if root is not None else sorted(self.roots(), key=lambda p: -p.pool_id)
        while stack:
            pool = stack.pop()
            yield pool
            stack.extend(sorted((self.pools[c] for c in pool.children), key=lambda p: -p.pool_id))

    def depth(self, pool: Pool) -> int:
        d = 0
        while pool.parent_id is not None:
            pool = self.pools[pool.parent_id]
            d += 1
        return d

    def descendants(self, pool: Pool) -> list[Pool]:
        out: list[Pool] = []
        stack = [pool]
        while stack:
            for cid in sorted(stack.pop().children):
                child = self.pools[cid]
                out.append(child)
                stack.append(child)
        return out

    @property
    def seq_ids_used(self) -> int:
        return len(self.seq_ids) - len(self._free_seqs)

    # ------------------------------------------------------------------ planning (no mutation)

    def existing_for(
        self, name: str | None, tokens: Sequence[int], parent: Pool | None
    ) -> Pool | None:
        """The pool a retried create with this name means, or None for a new pool.

        Same name, same tokens, same parent: the same pool (idempotent). Same name with
        anything different: 409.
        """
        if name is None:
            return None
        validate_name(name)
        pid = self._by_name.get(name)
        if pid is None:
            return None
        pool = self.pools[pid]
        if list(tokens) != pool.tokens:
            d = common_prefix_len(tokens, pool.tokens)
            raise PoolError(
                409,
                "name_conflict",
                f"pool {name!r} already exists with a different prefix (first difference at "
                f"token {d}; existing length {pool.prefix_len}, requested {len(tokens)})",
            )
        wanted_parent = parent.pool_id if parent else None
        if pool.parent_id != wanted_parent:
            raise PoolError(
                409, "name_conflict", f"pool {name!r} already exists under a different parent"
            )
        return pool

    def plan_root(self, tokens: Sequence[int], name: str | None) -> Pool:
        if not tokens:
            raise PoolError(400, "prefix_empty", "a pool prefix needs at least one token")
        return Pool(self._peek_id(), name, None, 0, list(tokens), chained_hashes(tokens))

    def plan_fork(
        self, parent: Pool, tokens: Sequence[int], branch_pos: int | None, name: str | None
    ) -> Pool:
        if not tokens:
            raise PoolError(400, "prefix_empty", "a pool prefix needs at least one token")
        shared = common_prefix_len(parent.tokens, tokens)
        if branch_pos is None:
            d = shared
        else:
            d = branch_pos
            if d > parent.prefix_len:
                raise PoolError(
                    409,
                    "branch_pos_invalid",
                    f"branch_pos {d} is beyond the end of parent {parent.label!r} "
                    f"(prefix_len {parent.prefix_len})",
                )
            if d > len(tokens):
                raise PoolError(
                    409,
                    "branch_pos_invalid",
                    f"branch_pos {d} is beyond the end of the child's prefix ({len(tokens)})",
                )
            if shared < d:
                raise PoolError(
                    409,
                    "prefix_mismatch",
                    f"the child's tokens differ from parent {parent.label!r} at position "
                    f"{shared}, before branch_pos {d}: tokens[0:D) must equal the parent's",
                )
        if d == 0:
            raise PoolError(
                409,
                "no_common_prefix",
                f"the child shares no tokens with parent {parent.label!r}; create a root pool "
                "instead",
            )
        if self.extend_only and d < parent.prefix_len:
            raise PoolError(
                409,
                "recurrent_branch",
                f"this model keeps a recurrent state, which exists only at the end of parent "
                f"{parent.label!r} (prefix_len {parent.prefix_len}): a child must extend it "
                f"(branch_pos {parent.prefix_len}, its tokens starting with the parent's whole "
                f"prefix), not branch at {d}; create a root pool for a different prefix",
            )
        hashes = chained_hashes(tokens, parent.hashes[:d])
        return Pool(self._peek_id(), name, parent.pool_id, d, list(tokens), hashes)

    def _peek_id(self) -> int:
        return self._next_id

    # ------------------------------------------------------------------ mutation

    def add(self, pool: Pool) -> Pool:
        """Register a planned pool and give it a sequence id (409 when none is left)."""
        if pool.name is not None and pool.name in self._by_name:
            raise PoolError(409, "name_conflict", f"pool name {pool.name!r} is taken")
        self._check_seq_free()  # before anything changes
        pool.pool_id = self._next_id
        self._next_id += 1
        self.pools[pool.pool_id] = pool
        self.give_seq(pool)
        if pool.name is not None:
            self._by_name[pool.name] = pool.pool_id
        if pool.parent_id is not None:
            self.pools[pool.parent_id].children.add(pool.pool_id)
        return pool

    def give_seq(self, pool: Pool) -> None:
        """Give ``pool`` a free sequence id (409 when none is left)."""
        self._check_seq_free()
        pool.seq_id = self._free_seqs.pop()
        self.by_seq[pool.seq_id] = pool
        self.mark(pool)

    def seq_free(self) -> bool:
        return bool(self._free_seqs)

    def _check_seq_free(self) -> None:
        if not self._free_seqs:
            raise PoolError(
                409,
                "seq_ids_exhausted",
                f"no free pool sequence id: all {len(self.seq_ids)} reserved by "
                "--polykv-max-pools are in use; release or evict a pool, or restart with a "
                "larger --polykv-max-pools",
                "capacity_error",
            )

    def give_back_seq(self, pool: Pool) -> None:
        if pool.seq_id is not None:
            self._free_seqs.append(pool.seq_id)
            del self.by_seq[pool.seq_id]
            pool.seq_id = None
            self.mark(pool)

    def set_residency(self, pool: Pool, residency: Residency) -> None:
        pool.residency = residency
        self.mark(pool)

    def mark(self, pool: Pool) -> None:
        """Note that ``pool``'s published figures (its residency, its admission policy, its
        existence) changed, so the engine republishes that pool alone."""
        self._changed.add(pool.pool_id)

    def take_changed(self) -> set[int]:
        """The pools marked since the last call (asked at every publish: usually none)."""
        if not self._changed:
            return self._changed
        changed, self._changed = self._changed, set()
        return changed

    def check_removable(self, pool: Pool) -> None:
        if pool.children:
            kids = ", ".join(self.pools[c].label for c in sorted(pool.children))
            raise PoolError(
                409,
                "has_children",
                f"pool {pool.label!r} has child pools ({kids}); release them first (leaves "
                "before parents)",
            )

    def remove(self, pool: Pool) -> None:
        self.check_removable(pool)
        self.give_back_seq(pool)
        del self.pools[pool.pool_id]
        self.mark(pool)  # an evicted pool has no sequence to give back
        if pool.name is not None:
            self._by_name.pop(pool.name, None)
        if pool.parent_id is not None:
            self.pools[pool.parent_id].children.discard(pool.pool_id)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raise AssertionError when the tree is inconsistent (tests call this)."""
        seqs = [p.seq_id for p in self.pools.values() if p.seq_id is not None]
        assert len(seqs) == len(set(seqs)), "a sequence id is used twice"
        assert all(s in self.seq_ids for s in seqs), "a sequence id is outside the pool range"
        assert len(seqs) + len(self._free_seqs) == len(self.seq_ids), "sequence ids leaked"
        assert self.by_seq == {p.seq_id: p for p in self.pools.values() if p.seq_id is not None}
        for name, pid in self._by_name.items():
            assert self.pools[pid].name == name
        for pool in self.pools.values():
            assert len(pool.hashes) == pool.prefix_len
            if pool.parent_id is None:
                assert pool.branch_pos == 0
                continue
            parent = self.pools[pool.parent_id]
            assert pool.pool_id in parent.children
            assert 0 < pool.branch_pos <= parent.prefix_len
            assert pool.tokens[: pool.branch_pos] == parent.tokens[: pool.branch_pos]
            assert pool.hashes[pool.branch_pos - 1] == parent.hashes[pool.branch_pos - 1]
            for c in pool.children:
                assert self.pools[c].parent_id == pool.pool_id
