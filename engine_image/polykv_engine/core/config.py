"""What an engine is started with: the runtime's settings and the engine's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from polykv_engine.core.tasks import SpecParams
from polykv_engine.llama.runtime import RuntimeConfig
from polykv_engine.policy.step_time import CeilingCurve


@dataclass(frozen=True, slots=True)
class EngineConfig:
    runtime: RuntimeConfig
    n_parallel: int = 1
    max_pools: int = 16
    context_shift: bool = False
    tps_window_tokens: int = 128
    tps_window_s: float = 2.0
    pool_grace_s: float = 10.0  # an idle pool is kept this long before KV pressure may evict it
    kv_debug: bool = False  # reserve a probe sequence to read llama.cpp's used-cell count
    warmup: bool = True  # run the model once before reporting ready (--no-warmup: skip)
    max_queue: int = 64  # requests waiting for a slot beyond which new ones get 503
    auto_share: bool = True  # share a prompt's prefix with any resident sequence (no pool)
    park_mib: int = 1024  # host memory for idle caches parked out of KV (0: never park)
    pause_aware_admission: bool = True  # admission counts sessions between turns as load
    admission_ceiling: CeilingCurve = "cycle"  # which step-time curve caps admission's projection
    prefill_budget: int = 0  # prompt tokens a step may carry while sessions decode (0: by floor)
    prefill_floor_tps: float = 0.0  # the floor pacing assumes for sessions without a pool floor
    spec: SpecParams = field(default_factory=SpecParams)  # for requests that do not choose
    draft_model: Path | None = None  # -md: a smaller model of the same vocabulary
    snapshot_dir: Path | None = None  # where pools' KV snapshots are kept (None: none are)
    snapshot_mib: int = 4096  # the most the snapshot store holds
    session_save_mib: int = 1024  # sessions' caches written there at shutdown (0: none)
    session_save_s: float = 5.0  # how long writing them may take, after the drain

    @property
    def snapshots_on(self) -> bool:
        """Whether the snapshot store is open: for pools, or for sessions' caches (which go
        through a scratch sequence: one unified cache, as with pools)."""
        sessions = self.session_save_mib > 0 and self.runtime.kv_unified
        return self.snapshot_dir is not None and (self.max_pools > 0 or sessions)
