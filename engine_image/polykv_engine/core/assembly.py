"""Putting an engine's parts together at start: the model, its cache, slots, pools, the draft
model and the snapshot store, each sized by the config and the model's kind of memory.

Runs once on the engine thread before its loop; the engine keeps what it returns.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from polykv_engine.core.config import EngineConfig
from polykv_engine.core.draft_model import DraftModel
from polykv_engine.core.slots import Slot, SlotTable
from polykv_engine.kv.cache import KVCache
from polykv_engine.kv.memory import Memory, swa_full_cost
from polykv_engine.llama.runtime import Batch, LlamaError, LlamaRuntime, RuntimeConfig
from polykv_engine.persist.key import Fingerprint, build_digest, file_digest
from polykv_engine.persist.store import SnapshotStore
from polykv_engine.policy.tps import SessionRate
from polykv_engine.pools.manager import PoolManager

log = logging.getLogger("polykv.engine")


@dataclass(frozen=True, slots=True)
class Parts:
    runtime: LlamaRuntime
    memory: Memory
    batch: Batch
    kv: KVCache
    slots: SlotTable
    pools: PoolManager
    drafter: DraftModel | None
    snapshots: SnapshotStore | None
    pools_disabled_reason: str | None
    swa_full_cost: int  # bytes the full-size SWA cache adds (pools on an SWA model)


def assemble(cfg: EngineConfig, n_seq_max: int, scratch_seq: int | None, parks: bool) -> Parts:
    """Loads the model (and the draft model) and builds the cache, slots and pools on it.
    `scratch_seq` is the spare sequence that parking and snapshots go through."""
    pools_on = cfg.max_pools > 0
    # Pools on a sliding-window model: a pool of any length, attached or branched at any
    # point, needs the window layers to keep every cell too (a full-size SWA cache; no
    # effect on other models), and each pool a guard sequence (kv.cache).
    rcfg = replace(
        cfg.runtime,
        n_seq_max=n_seq_max,
        swa_full=cfg.runtime.swa_full or pools_on,
        guard_seqs=cfg.max_pools,
    )
    t0 = time.perf_counter()
    snapshots: SnapshotStore | None = None
    with concurrent.futures.ThreadPoolExecutor(1) as hasher:
        # The model file's digest keys its snapshots: read beside the model's load.
        model_digest = hasher.submit(file_digest, rcfg.model_path) if cfg.snapshots_on else None
        rt = LlamaRuntime(rcfg)
        if model_digest is not None:
            snapshots = _open_snapshots(cfg, rt, model_digest.result())
    info = rt.info
    memory = Memory.of(info.is_recurrent, info.is_hybrid, info.n_swa)
    drafter = _load_drafter(cfg, cfg.draft_model, rt) if cfg.draft_model else None
    if cfg.warmup:
        tw = time.perf_counter()
        rt.warm_up(0)
        log.info("warm-up decode done in %.2fs", time.perf_counter() - tw)
    n_ctx_slot = min(rt.n_ctx_seq, info.n_ctx_train or rt.n_ctx_seq)
    pool_seqs = range(cfg.n_parallel, cfg.n_parallel + cfg.max_pools)
    guards = {seq: n_seq_max + i for i, seq in enumerate(pool_seqs)}
    kv = KVCache(rt, guards if rt.guard_seqs else None)
    slots = SlotTable(
        [
            Slot(i, n_ctx_slot, SessionRate(cfg.tps_window_tokens, cfg.tps_window_s))
            for i in range(cfg.n_parallel)
        ],
        kv,
        scratch_seq if parks and memory.plain else None,
        cfg.park_mib << 20,
        memory,
    )
    pools = PoolManager(
        kv,
        pool_seqs,
        rt.kv_bytes_per_token,
        cfg.pool_grace_s,
        slots.session_tokens,
        state_bytes=rt.state_bytes,
        extend_only=memory.exact_length,
        on_removed=slots.unlink_pool,
        store=snapshots,
        scratch=scratch_seq,
    )
    disabled, extra = _pools_on_this_memory(cfg, rcfg, rt, memory)
    log.info(
        "model loaded in %.2fs: %s, n_ctx=%d (per slot %d), n_batch=%d, slots=%d, "
        "seq ids=%d (pools %d), kv_unified=%s",
        time.perf_counter() - t0,
        info.description,
        rt.n_ctx,
        n_ctx_slot,
        rt.n_batch,
        cfg.n_parallel,
        n_seq_max,
        cfg.max_pools,
        rcfg.kv_unified,
    )
    if cfg.context_shift and pools_on:
        log.warning(
            "--context-shift with pools: a session whose context holds pool-shared cells "
            "is never shifted (that would corrupt the pool for everyone); it stops with "
            "truncated=true instead. Compact by re-forking (docs/concepts.md, "
            "'Context and compaction')."
        )
    return Parts(rt, memory, rt.new_batch(), kv, slots, pools, drafter, snapshots, disabled, extra)


def _pools_on_this_memory(
    cfg: EngineConfig, rcfg: RuntimeConfig, rt: LlamaRuntime, memory: Memory
) -> tuple[str | None, int]:
    """Why pools are off (None: they are on), and the bytes a full-size SWA cache adds."""
    info = rt.info
    if cfg.max_pools <= 0:
        return "pools are disabled (--polykv-max-pools 0)", 0
    if memory.kind == "hybrid" and info.n_swa > 0:
        # Its attention layers recycle cells like any sliding window, and a guard
        # sequence cannot share a recurrent state: a pool could not be kept whole.
        reason = (
            f"this hybrid model has sliding-window attention (window {info.n_swa} "
            "tokens) beside its recurrent state: llama.cpp recycles the window's cells "
            "and a recurrent sequence cannot be guarded against that, so pools are "
            "disabled on it (sessions and prompt caching still work)"
        )
        log.warning("pools disabled: %s", reason)
        return reason, 0
    if memory.guarded:
        # Against the window-sized cache the same -c and -np get without pools.
        n_ubatch = min(rcfg.n_ubatch, rcfg.n_batch)
        cost = swa_full_cost(
            rt.n_ctx, info.n_swa, cfg.n_parallel, n_ubatch, rcfg.kv_unified,
            rt.swa_bytes_per_token,
        )  # fmt: skip
        log.info(
            "sliding-window model (window %d tokens): pools keep their cells with guard "
            "sequences, and the window layers keep a full-size cache: %.1f MiB more than "
            "a window-sized one (%d bytes per token of context)",
            info.n_swa,
            cost / 2**20,
            rt.swa_bytes_per_token,
        )
        return None, cost
    if memory.exact_length:
        log.info(
            "%s model: a pool is attached at exactly its length and forks extend their "
            "parent (recurrent state %d bytes per sequence)",
            memory.kind,
            rt.state_bytes,
        )
    return None, 0


def _load_drafter(cfg: EngineConfig, path: Path, rt: LlamaRuntime) -> DraftModel:
    """The draft model: one sequence per slot in a cache as large as the model's."""
    dcfg = replace(
        cfg.runtime,
        model_path=path,
        n_ctx=rt.n_ctx,
        n_seq_max=cfg.n_parallel,
        kv_debug=False,
        swa_full=False,
        guard_seqs=0,
    )
    draft_rt = LlamaRuntime(dcfg)
    try:
        drafter = DraftModel(draft_rt, rt.info.n_vocab)
    except LlamaError:
        draft_rt.close()
        raise
    log.info("draft model loaded: %s", draft_rt.info.description)
    return drafter


def _open_snapshots(cfg: EngineConfig, rt: LlamaRuntime, model_digest: str) -> SnapshotStore:
    """The snapshot store, keyed by this model file, llama.cpp build and cache layout."""
    assert cfg.snapshot_dir is not None
    build = build_digest(rt.library_files(), rt.build_label)
    fingerprint = Fingerprint(model_digest, build, rt.kv_layout())
    store = SnapshotStore(
        cfg.snapshot_dir,
        cfg.snapshot_mib << 20,
        fingerprint,
        rt.kv_bytes_per_token,
        rt.state_bytes,
    )
    log.info(
        "KV snapshots in %s: %d files, %.1f of %d MiB; model %s, build %s, layout %s",
        cfg.snapshot_dir,
        store.n_files,
        store.used_bytes / 2**20,
        cfg.snapshot_mib,
        model_digest[:12],
        build[:12],
        fingerprint.layout,
    )
    return store
