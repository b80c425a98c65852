"""``PolyKVClient`` (sync) and ``AsyncPolyKVClient``: the pool API of one engine, typed.

Both drive the operations of ``ops`` over httpx, so every method exists in both with the
same signature (the async one returns a coroutine). Keys: ``api_key`` is sent on reads,
``admin_key`` on mutations (each falls back to the other), as ``Authorization: Bearer``.
A transport failure, a 5xx or an answer that is not the contract raises
``EngineUnavailable``; any other error answer the ``RequestRejected`` subclass of its
``reason`` code (``errors.ERRORS``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import httpx

from . import ops
from .errors import EngineUnavailable, error_from_response
from .ops import Call, Op

P = ParamSpec("P")
T = TypeVar("T")

DEFAULT_TIMEOUT = 30.0
# Creating or forking a pool waits for its prefill; a long prefix on a CPU takes a while.
DEFAULT_CREATE_TIMEOUT = 300.0

Timeout = float | httpx.Timeout


class _Runs(Protocol):
    def run(self, op: Op[T]) -> T: ...


class _ARuns(Protocol):
    async def run(self, op: Op[T]) -> T: ...


def _sync(op: Callable[P, Op[T]]) -> Callable[Concatenate[_Runs, P], T]:
    """A blocking method running the operation ``op``."""

    def method(self: _Runs, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.run(op(*args, **kwargs))

    functools.update_wrapper(method, op)
    return method


def _async(op: Callable[P, Op[T]]) -> Callable[Concatenate[_ARuns, P], Coroutine[Any, Any, T]]:
    """A coroutine method running the operation ``op``."""

    async def method(self: _ARuns, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.run(op(*args, **kwargs))

    functools.update_wrapper(method, op)
    return method


class _Base:
    """What both clients share: the base URL, keys, timeouts, and turning one response into
    a result or a typed error."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        admin_key: str | None,
        timeout: Timeout,
        create_timeout: Timeout,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.admin_key = admin_key
        self.timeout = timeout
        self.create_timeout = create_timeout

    def _request(self, call: Call) -> dict[str, Any]:
        key = (self.admin_key or self.api_key) if call.admin else (self.api_key or self.admin_key)
        return {
            "method": call.method,
            "url": self.base_url + call.path,
            "json": call.json,
            "params": call.params,
            "headers": {
                **(call.headers or {}),
                **({"Authorization": f"Bearer {key}"} if key else {}),
            },
            "timeout": self.create_timeout if call.slow else self.timeout,
        }

    @staticmethod
    def _failed(call: Call, exc: httpx.HTTPError) -> EngineUnavailable:
        text = f"{type(exc).__name__}: {exc}".rstrip(": ")
        return EngineUnavailable(None, f"{call.method} {call.path}: {text}")

    def _advance(self, op: Op[T], call: Call, outcome: httpx.Response | httpx.HTTPError) -> Call:
        """Hand the operation its call's outcome (an error answer or a transport failure
        thrown in as a typed error); its next call, or StopIteration with its result."""
        if isinstance(outcome, httpx.HTTPError):
            return op.throw(self._failed(call, outcome))
        if outcome.status_code < 400:
            return op.send(outcome)
        try:
            body: Any = outcome.json()
        except ValueError:
            body = outcome.text
        return op.throw(error_from_response(outcome.status_code, outcome.headers, body))


class PolyKVClient(_Base):
    """A blocking client for one engine (``base_url``: ``http://host:port``; a trailing
    ``/v1`` is dropped, so an OpenAI base URL works too). Pass ``http`` to share an
    ``httpx.Client``; otherwise the client owns one (``close()`` or ``with``)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        create_timeout: Timeout = DEFAULT_CREATE_TIMEOUT,
        http: httpx.Client | None = None,
    ) -> None:
        super().__init__(base_url, api_key, admin_key, timeout, create_timeout)
        self._owned = http is None
        self.http = http or httpx.Client()

    def close(self) -> None:
        if self._owned:
            self.http.close()

    def __enter__(self) -> PolyKVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, op: Op[T]) -> T:
        """Drive one operation of ``ops`` to its result."""
        try:
            call = next(op)
            while True:
                try:
                    outcome: httpx.Response | httpx.HTTPError = self.http.request(
                        **self._request(call)
                    )
                except httpx.HTTPError as exc:
                    outcome = exc
                call = self._advance(op, call, outcome)
        except StopIteration as done:
            result: T = done.value
            return result

    create_pool = _sync(ops.create_pool)
    fork_pool = _sync(ops.fork_pool)
    get_pool = _sync(ops.get_pool)
    list_pools = _sync(ops.list_pools)
    list_pools_if_changed = _sync(ops.list_pools_if_changed)
    pin = _sync(ops.pin)
    unpin = _sync(ops.unpin)
    pool_action = _sync(ops.pool_action)
    release = _sync(ops.release)
    release_subtree = _sync(ops.release_subtree)
    set_admission = _sync(ops.set_admission)
    clear_admission = _sync(ops.clear_admission)
    capacity = _sync(ops.capacity)
    tps = _sync(ops.tps)
    session = _sync(ops.session)
    tokenize = _sync(ops.tokenize)
    apply_template = _sync(ops.apply_template)


class AsyncPolyKVClient(_Base):
    """The same operations as ``PolyKVClient``, as coroutines, over an
    ``httpx.AsyncClient`` (shared when given as ``http``; else owned: ``aclose()``)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        admin_key: str | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        create_timeout: Timeout = DEFAULT_CREATE_TIMEOUT,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(base_url, api_key, admin_key, timeout, create_timeout)
        self._owned = http is None
        self.http = http or httpx.AsyncClient()

    async def aclose(self) -> None:
        if self._owned:
            await self.http.aclose()

    async def __aenter__(self) -> AsyncPolyKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def run(self, op: Op[T]) -> T:
        """Drive one operation of ``ops`` to its result."""
        try:
            call = next(op)
            while True:
                try:
                    outcome: httpx.Response | httpx.HTTPError = await self.http.request(
                        **self._request(call)
                    )
                except httpx.HTTPError as exc:
                    outcome = exc
                call = self._advance(op, call, outcome)
        except StopIteration as done:
            result: T = done.value
            return result

    create_pool = _async(ops.create_pool)
    fork_pool = _async(ops.fork_pool)
    get_pool = _async(ops.get_pool)
    list_pools = _async(ops.list_pools)
    list_pools_if_changed = _async(ops.list_pools_if_changed)
    pin = _async(ops.pin)
    unpin = _async(ops.unpin)
    pool_action = _async(ops.pool_action)
    release = _async(ops.release)
    release_subtree = _async(ops.release_subtree)
    set_admission = _async(ops.set_admission)
    clear_admission = _async(ops.clear_admission)
    capacity = _async(ops.capacity)
    tps = _async(ops.tps)
    session = _async(ops.session)
    tokenize = _async(ops.tokenize)
    apply_template = _async(ops.apply_template)
