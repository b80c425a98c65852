"""Typed messages between the HTTP side and the engine thread.

HTTP handlers build a ``GenerateTask`` and hand it to the engine; the engine answers through
the task's ``EventSink`` with ``TokenEvent``s and exactly one terminal event (``DoneEvent`` or
``ErrorEvent``). Nothing else crosses the thread boundary.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from polykv_api.models import PoolRef, Reason
from polykv_engine.llama.grammar import CompiledGrammar
from polykv_engine.llama.runtime import TokenLogprobs
from polykv_engine.llama.sampling import SamplingParams, StopParams
from polykv_engine.persist.fileformat import KVSnapshot

if TYPE_CHECKING:
    from polykv_engine.pools.tree import Pool

_task_ids = itertools.count(1)


def next_task_id() -> int:
    return next(_task_ids)


StopType = Literal["eos", "word", "limit", "none"]
SpecType = Literal["none", "ngram", "draft"]


@dataclass(frozen=True, slots=True)
class SpecParams:
    """Speculative decoding for a request: ``ngram`` drafts from the session's own context
    (``policy.speculation``), ``draft`` with the engine's draft model (``core.draft_model``);
    at most ``n_max`` tokens a step, none shorter than ``n_min``."""

    type: SpecType = "none"
    n_max: int = 16
    n_min: int = 0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    text: str  # may be empty: bytes of an unfinished character or a possible stop string
    token: int
    logprobs: TokenLogprobs | None = None  # when the request asked for them


@dataclass(frozen=True, slots=True)
class GenerationResult:
    content: str
    tokens: list[int]
    stop_type: StopType
    stopping_word: str
    truncated: bool
    slot: int
    session_id: str | None
    seed: int
    prompt_n: int  # prompt tokens computed for this request
    cache_n: int  # prompt tokens reused from the KV cache
    predicted_n: int
    prompt_ms: float
    predicted_ms: float
    tps_ewma: float
    pool_id: int | None = None
    shared_prefix: int = 0  # leading prompt tokens whose KV cells are the pool's
    draft_n: int = 0  # tokens speculation drafted this turn
    draft_n_accepted: int = 0  # of those, kept (each one a step saved)

    @property
    def n_prompt_tokens(self) -> int:
        return self.prompt_n + self.cache_n


@dataclass(frozen=True, slots=True)
class DoneEvent:
    result: GenerationResult


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    status: int
    type: str
    message: str
    reason: Reason = "internal"
    retry_after: int | None = None  # seconds, when trying again later can succeed


Event = TokenEvent | DoneEvent | ErrorEvent


class EventSink(Protocol):
    """Receives a task's events. Both methods are called from the engine thread."""

    def emit(self, event: Event) -> None: ...

    def flush(self) -> None:
        """Hand over any events the sink holds back (the engine is about to take a while)."""


@dataclass(slots=True)
class GenerateTask:
    prompt: list[int]
    sampling: SamplingParams
    stop: StopParams
    sink: EventSink
    grammar: CompiledGrammar | None = None  # sampling.grammar, parsed off the engine thread
    session_id: str | None = None
    # Opaque, from the auth middleware: sessions, prompt caches and automatic prefix sharing
    # never cross tenants (the same session id under two tenants is two sessions).
    tenant: str = ""
    id_slot: int = -1
    cache_prompt: bool = True
    n_keep: int = 0
    pool_ref: PoolRef | None = None  # attach to this pool (id or name)
    pool_p: int | None = None  # explicit shared prefix length; None = auto-P
    pool_kept: bool = False  # the pool is a kept prefix (pools.kept): if gone, run without
    logprobs: int | None = None  # report each token's logprob and this many alternatives
    spec: SpecParams | None = None  # None: the engine's default (--spec-type)
    preserved_tokens: frozenset[int] = frozenset()  # special tokens rendered as text
    # The session's cache as an earlier process saved it (``core.session_snapshots``), read
    # and checked off the engine thread; loaded into its slot when the turn begins.
    restore: KVSnapshot | None = None
    task_id: int = field(default_factory=next_task_id)
    submitted_at: float = 0.0
    # Filled in on the engine thread:
    pool: Pool | None = None
    pool_fallback: str | None = None  # why the pool could not be used (served without it)
    shared_prefix: int = 0
    n_cached: int = 0  # prompt tokens reused from KV, known once the task holds its slot
    slot_id: int = -1
    prev_tps: float = 0.0  # the session's experienced tps at the end of its previous turn
