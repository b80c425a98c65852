"""A typed client for the PolyKV engine's pool API (sync and async), its refusals as typed
exceptions, and the signals a completion response carries in its headers.

Depends on pydantic, httpx and the wire contract (``polykv_api``) only: never on the engine
server, so agents, routers and the operator can all use it.
"""

from .client import AsyncPolyKVClient, PolyKVClient
from .errors import (
    ERRORS,
    AuthError,
    EngineUnavailable,
    HasChildren,
    InvalidReference,
    InvalidRequest,
    NameConflict,
    PolyKVError,
    PoolBusy,
    PoolNotFound,
    PoolSaturated,
    PoolsDisabled,
    PrefixMismatch,
    PrefixTooLong,
    RequestRejected,
    SeqIdsExhausted,
    SessionBusy,
    SessionNotFound,
    error_from_response,
)
from .ops import Revalidated
from .signals import SESSION_ID, Signals

__all__ = [
    "ERRORS",
    "SESSION_ID",
    "AsyncPolyKVClient",
    "AuthError",
    "EngineUnavailable",
    "HasChildren",
    "InvalidReference",
    "InvalidRequest",
    "NameConflict",
    "PolyKVClient",
    "PolyKVError",
    "PoolBusy",
    "PoolNotFound",
    "PoolSaturated",
    "PoolsDisabled",
    "PrefixMismatch",
    "PrefixTooLong",
    "RequestRejected",
    "Revalidated",
    "SeqIdsExhausted",
    "SessionBusy",
    "SessionNotFound",
    "Signals",
    "error_from_response",
]
