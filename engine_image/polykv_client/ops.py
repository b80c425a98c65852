"""Every engine operation, written once without I/O.

An operation is a generator: it yields the ``Call`` it wants made, receives the
``httpx.Response`` (an error answer is thrown into it as a typed ``PolyKVError`` instead,
so an operation may handle one), and returns the typed result. ``client.PolyKVClient``
and ``client.AsyncPolyKVClient`` drive the same generators over a sync or an async
transport, so the two clients cannot drift apart. Operations that take several requests
(``release_subtree``) are written the same way. Every pool or session reference goes into
a path through ``refs`` (checked, percent-encoded), never as it came.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from polykv_api import models as wire

from . import refs
from .errors import EngineUnavailable, PoolNotFound

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

Op = Generator["Call", httpx.Response, T]
"""An operation: yields calls, receives their responses, returns its result."""

Message = wire.ChatMessage | Mapping[str, Any]
"""A chat message: the wire model, or an OpenAI-style dict (``{"role", "content"}``)."""

PoolAction = Literal["pin", "unpin", "evict", "flush"]


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP request an operation wants made."""

    method: str
    path: str
    json: Any = None
    params: Mapping[str, str | int] | None = None
    admin: bool = False  # a mutation: send the admin key
    slow: bool = False  # waits for a prefill: use the long timeout
    headers: Mapping[str, str] | None = None


def parse(resp: httpx.Response, model: type[M]) -> M:
    """The answer as ``model``; one that is not the contract is an unusable answer."""
    try:
        return model.model_validate(resp.json())
    except (ValidationError, ValueError) as exc:
        raise EngineUnavailable(
            resp.status_code, f"unexpected answer to {resp.request.url.path}: {exc}"
        ) from exc


def _body(
    cls: type[wire.PoolCreateRequest] | type[wire.PoolForkRequest],
    request: wire.PoolPrefix | None,
    args: Mapping[str, Any],
) -> dict[str, Any]:
    """A create or fork body: the given ``request``, else one built from the operation's
    keyword arguments (``args``: its ``locals()``)."""
    if request is None:
        fields = {k: v for k, v in args.items() if k in cls.model_fields}
        given = {k: v for k, v in fields.items() if v is not None and v is not False}
        if "messages" in given:
            given["messages"] = _messages(given["messages"])
        for key in ("tokens", "tools"):
            if key in given:
                given[key] = [t if isinstance(t, int) else dict(t) for t in given[key]]
        request = cls.model_validate(given)
    return request.model_dump(mode="json", exclude_none=True, by_alias=True)


def _messages(messages: Sequence[Message]) -> list[wire.ChatMessage]:
    return _MESSAGES.validate_python(
        [m.model_dump(exclude_none=True) if isinstance(m, BaseModel) else dict(m) for m in messages]
    )


_MESSAGES = TypeAdapter(list[wire.ChatMessage])


# ----------------------------------------------------------------------- pools


def create_pool(
    request: wire.PoolPrefix | None = None,
    *,
    prompt: str | None = None,
    tokens: Sequence[int] | None = None,
    messages: Sequence[Message] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    from_session: str | None = None,
    name: str | None = None,
    pin: bool = False,
    dry_run: bool = False,
) -> Op[wire.PoolCreated]:
    """Create a root pool from exactly one of ``prompt`` (text), ``tokens``, ``messages``
    (+ ``tools``: rendered with the model's chat template, the system block a chat attach
    shares) or ``from_session`` (a live session's context), or from a built ``request``.
    Idempotent by ``name``: the same prefix again returns the existing pool
    (``created=False``); a different one raises ``NameConflict``."""
    body = _body(wire.PoolCreateRequest, request, locals())
    if body.get("name") is not None:
        refs.pool_name(body["name"])
    resp = yield Call("POST", "/polykv/pools", body, admin=True, slow=True)
    return parse(resp, wire.PoolCreated)


def fork_pool(
    parent: wire.PoolRef,
    request: wire.PoolPrefix | None = None,
    *,
    prompt: str | None = None,
    tokens: Sequence[int] | None = None,
    messages: Sequence[Message] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    from_session: str | None = None,
    name: str | None = None,
    pin: bool = False,
    dry_run: bool = False,
    branch_pos: int | None = None,
) -> Op[wire.PoolCreated]:
    """Fork ``parent``: the child's FULL prefix (not a suffix), given like ``create_pool``.
    It shares the parent's cells up to ``branch_pos`` (default: the longest common prefix;
    the parent's whole length extends it) and prefills only the rest. A prefix that does
    not extend the parent there raises ``PrefixMismatch``."""
    body = _body(wire.PoolForkRequest, request, locals())
    if body.get("name") is not None:
        refs.pool_name(body["name"])
    resp = yield Call(
        "POST", f"/polykv/pools/{refs.pool_ref(parent)}/fork", body, admin=True, slow=True
    )
    return parse(resp, wire.PoolCreated)


def get_pool(ref: wire.PoolRef) -> Op[wire.PoolDetail]:
    """One pool with its subtree (``descendants``) and the engine's boot id."""
    resp = yield Call("GET", f"/polykv/pools/{refs.pool_ref(ref)}")
    return parse(resp, wire.PoolDetail)


def list_pools() -> Op[wire.PoolList]:
    """Every pool on the engine, with KV attribution, sessions and capacity summaries."""
    resp = yield Call("GET", "/polykv/pools")
    return parse(resp, wire.PoolList)


@dataclass(frozen=True, slots=True)
class Revalidated:
    """A listing asked for with the ETag of an earlier one: ``listing`` is None when it is
    unchanged (304); ``etag`` names the listing now held either way."""

    listing: wire.PoolList | None
    etag: str | None


def list_pools_if_changed(etag: str | None) -> Op[Revalidated]:
    """``list_pools`` for pollers: with the ETag of the listing they hold, an unchanged one
    costs a 304 and no parsing."""
    headers = {"If-None-Match": etag} if etag else None
    resp = yield Call("GET", "/polykv/pools", headers=headers)
    now = resp.headers.get("ETag")
    if resp.status_code == 304:
        return Revalidated(None, now or etag)
    return Revalidated(parse(resp, wire.PoolList), now)


def pool_action(ref: wire.PoolRef, action: PoolAction) -> Op[wire.PoolStatus]:
    """``pin`` (never evicted), ``unpin``, ``evict`` (drop its KV, keep the pool) or
    ``flush`` (evict its whole subtree)."""
    resp = yield Call(
        "POST", f"/polykv/pools/{refs.pool_ref(ref)}/{refs.segment(action)}", admin=True
    )
    return parse(resp, wire.PoolStatus)


def pin(ref: wire.PoolRef) -> Op[wire.PoolStatus]:
    """Keep the pool resident: never evicted under KV pressure until unpinned."""
    return (yield from pool_action(ref, "pin"))


def unpin(ref: wire.PoolRef) -> Op[wire.PoolStatus]:
    """Drop an explicit pin (the engine still pins a pool while it is in use)."""
    return (yield from pool_action(ref, "unpin"))


def release(ref: wire.PoolRef) -> Op[wire.PoolReleased]:
    """Remove the pool (children first, else ``HasChildren``). Sessions still holding its
    cells keep them."""
    resp = yield Call("DELETE", f"/polykv/pools/{refs.pool_ref(ref)}", admin=True)
    return parse(resp, wire.PoolReleased)


def release_subtree(ref: wire.PoolRef, missing_ok: bool = True) -> Op[list[int]]:
    """Release ``ref`` and every pool below it, deepest first, pins and all; the ids
    released. A pool already gone is skipped (``missing_ok``) rather than an error."""
    try:
        detail = yield from get_pool(ref)
    except PoolNotFound:
        if missing_ok:
            return []
        raise
    order = sorted([*detail.descendants, detail], key=lambda p: p.depth, reverse=True)
    released: list[int] = []
    for pool in order:
        try:
            done = yield from release(pool.pool_id)
        except PoolNotFound:
            if not missing_ok:
                raise
            continue
        released.append(done.released)
    return released


def set_admission(ref: wire.PoolRef, policy: wire.AdmissionPolicy) -> Op[wire.PoolStatus]:
    """Install the pool's admission policy (a tps floor, advisory or enforced)."""
    body = policy.model_dump(mode="json")
    resp = yield Call("POST", f"/polykv/pools/{refs.pool_ref(ref)}/admission", body, admin=True)
    return parse(resp, wire.PoolStatus)


def clear_admission(ref: wire.PoolRef) -> Op[wire.PoolStatus]:
    """Remove the pool's admission policy."""
    resp = yield Call("DELETE", f"/polykv/pools/{refs.pool_ref(ref)}/admission", admin=True)
    return parse(resp, wire.PoolStatus)


def capacity(
    ref: wire.PoolRef, expected_tokens: int | None = None, session_id: str | None = None
) -> Op[wire.CapacityReport]:
    """May one more session join ``ref`` now? ``expected_tokens`` adds the context arm (will
    that many tokens fit); a ``session_id`` the engine knows is a continuation (admitted)."""
    params: dict[str, str | int] = {}
    if expected_tokens is not None:
        params["expected_tokens"] = expected_tokens
    if session_id is not None:
        params["session_id"] = session_id
    resp = yield Call("GET", f"/polykv/pools/{refs.pool_ref(ref)}/capacity", params=params)
    return parse(resp, wire.CapacityReport)


# ----------------------------------------------------------------------- engine-wide


def tps() -> Op[wire.TpsSnapshot]:
    """Aggregate and per-session decode tps, and ``mean_active_tps`` (the floor's measure)."""
    resp = yield Call("GET", "/polykv/tps")
    return parse(resp, wire.TpsSnapshot)


def session(session_id: str) -> Op[wire.SessionInfo]:
    """Where a session lives on this engine (``SessionNotFound`` when it holds none)."""
    resp = yield Call("GET", f"/polykv/sessions/{refs.session_id(session_id)}")
    return parse(resp, wire.SessionInfo)


class _Tokens(BaseModel):
    tokens: list[int]


class _Prompt(BaseModel):
    prompt: str


def tokenize(content: str, add_special: bool = False, parse_special: bool = True) -> Op[list[int]]:
    """The model's token ids for ``content``."""
    body = wire.TokenizeRequest(
        content=content, add_special=add_special, parse_special=parse_special
    ).model_dump()
    resp = yield Call("POST", "/tokenize", body)
    return parse(resp, _Tokens).tokens


def apply_template(
    messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
) -> Op[str]:
    """The prompt text a chat request with these messages (and tools) is rendered to,
    generation prompt included."""
    body: dict[str, Any] = {
        "messages": [m.model_dump(mode="json", exclude_none=True) for m in _messages(messages)]
    }
    if tools is not None:
        body["tools"] = [dict(t) for t in tools]
    resp = yield Call("POST", "/apply-template", body)
    return parse(resp, _Prompt).prompt
