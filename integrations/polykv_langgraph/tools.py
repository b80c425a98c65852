"""The pool tree an agent program builds, and the pool API as LangChain tools.

A fork's prefix is the child's FULL prefix, and the engine keeps tokens, not messages; so
``PoolTree`` remembers the messages (and tools) each pool was rendered from, and forks a
child as its parent's messages plus its own. Pools made elsewhere (by the operator from a
``PolyKVPool``) are ``adopt``-ed with the messages they were made from.

``pool_tools(tree)`` gives an agent ``create_pool``, ``fork_pool``, ``pool_status``,
``session_tps`` and ``capacity`` for ``bind_tools`` / ``ToolNode``. A refusal comes back to
the agent as text naming the engine's reason code, never as an exception that would end
the graph. Given ``pools``, the pool arguments are an enum of those names, which a grammar
enforcing engine turns into a constraint even a small model cannot break.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.tools import BaseTool, StructuredTool
from pydantic import BaseModel, Field, create_model

from polykv_api import models as wire
from polykv_client import PolyKVClient, PolyKVError
from polykv_client.refs import pool_name, pool_ref

Message = dict[str, Any]


@dataclass
class Prefix:
    """What a pool was rendered from."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    parent: str | None = None


@dataclass
class PoolTree:
    """The pools this program made or adopted, by name, with their prefixes."""

    client: PolyKVClient
    prefixes: dict[str, Prefix] = field(default_factory=dict)

    def adopt(
        self,
        name: str,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        parent: str | None = None,
    ) -> None:
        """Remember a pool made elsewhere (its full messages, as it was made)."""
        self.prefixes[name] = Prefix(list(messages), _tools(tools), parent)

    def root(
        self,
        name: str,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        pin: bool = False,
    ) -> wire.PoolCreated:
        """Create (or find, by name) a root pool from chat messages (+ tools)."""
        made = self.client.create_pool(messages=messages, tools=tools, name=name, pin=pin)
        self.adopt(name, messages, tools)
        return made

    def fork(
        self,
        parent: str,
        name: str,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        pin: bool = False,
    ) -> wire.PoolCreated:
        """Fork ``parent`` with ``messages`` appended to its prefix (and ``tools``, default
        the parent's: other tools change the rendered system block, so the child then
        branches where they differ instead of extending)."""
        base = self.prefix(parent)
        full = [*base.messages, *messages]
        use = _tools(tools) if tools is not None else base.tools
        made = self.client.fork_pool(parent, messages=full, tools=use, name=name, pin=pin)
        self.prefixes[name] = Prefix(full, use, parent)
        return made

    def prefix(self, name: str) -> Prefix:
        try:
            return self.prefixes[name]
        except KeyError:
            known = ", ".join(sorted(self.prefixes)) or "none"
            raise KeyError(f"pool {name!r} is not in this tree (known: {known})") from None

    def release(self, name: str) -> list[int]:
        """Release ``name`` and everything below it on the engine (pins included), and
        forget them."""
        gone = {name} | {n for n, p in self.prefixes.items() if self._below(p, name)}
        released = self.client.release_subtree(name)
        for n in gone:
            self.prefixes.pop(n, None)
        return released

    def _below(self, prefix: Prefix, ancestor: str) -> bool:
        parent = prefix.parent
        while parent is not None:
            if parent == ancestor:
                return True
            parent = self.prefixes[parent].parent if parent in self.prefixes else None
        return False


def _tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    return [dict(t) for t in tools] if tools is not None else None


# ----------------------------------------------------------------------- tools


def _answer(fn: Callable[..., Any]) -> Callable[..., str]:
    """Run a tool body; a refusal is the agent's to read, not the graph's to crash on."""

    def run(**kwargs: Any) -> str:
        try:
            return json.dumps(fn(**kwargs))
        except PolyKVError as exc:
            return json.dumps({"error": exc.reason or "refused", "message": exc.message})
        except KeyError as exc:
            return json.dumps({"error": "unknown_pool", "message": str(exc.args[0])})

    return run


def _pool_arg(pools: Sequence[str] | None) -> Any:
    if not pools:
        return (str, Field(description="a pool name"))
    return (Literal[tuple(pools)], Field(description="a pool name"))


def _schema(title: str, /, **fields: Any) -> type[BaseModel]:
    return create_model(title, **fields)


# A new pool's name: a Kubernetes-style label (so the operator can adopt it) that starts with
# a letter, so never all digits: a subset of the engine's names (pools/tree.py NAME_RE, whose
# lookahead no grammar can take), hence enforceable while the model writes it.
NAME_PATTERN = "^[a-z][a-z0-9-]{0,62}$"


def pool_tools(
    tree: PoolTree, pools: Sequence[str] | None = None, max_instructions: int = 400
) -> list[BaseTool]:
    """``create_pool``, ``fork_pool``, ``pool_status``, ``session_tps``, ``capacity``.

    ``pools`` restricts the pool arguments (parents, status, capacity) to those names.
    Every string argument is bounded (``max_instructions`` characters for a new pool's
    instructions), so on a grammar-enforcing engine a call ends even when a small model
    would loop inside a string: give the call max_tokens for that many characters."""
    client = tree.client
    pool_arg = _pool_arg(pools)
    text_arg = (
        str,
        Field(
            description="the instructions the new pool's agents share",
            max_length=max_instructions,
        ),
    )
    new_name = (
        str,
        Field(
            description="a name for the new pool (lowercase letters, digits, -; a letter first)",
            pattern=NAME_PATTERN,
        ),
    )

    # A model chooses these names: each is checked with the engine's own rule (polykv_client
    # refs) before anything is sent; a bad one is a tool error (name_invalid), not a call.
    def create(name: str, instructions: str) -> dict[str, Any]:
        pool_name(name)
        made = tree.root(name, [{"role": "system", "content": instructions}])
        return {"created": name, "pool_id": made.pool_id, "prefix_len": made.prefix_len}

    def fork(parent: str, name: str, instructions: str) -> dict[str, Any]:
        pool_ref(parent)
        pool_name(name)
        made = tree.fork(parent, name, [{"role": "system", "content": instructions}])
        return {
            "created": name,
            "parent": parent,
            "pool_id": made.pool_id,
            "prefix_len": made.prefix_len,
            "shared_with_parent": made.branch_pos,
        }

    def status(pool: str) -> dict[str, Any]:
        pool_ref(pool)
        p = client.get_pool(pool)
        return {
            "pool": p.name or p.pool_id,
            "prefix_len": p.prefix_len,
            "children": [d.name or d.pool_id for d in p.descendants if d.parent == p.pool_id],
            "sessions": len(p.sessions),
            "pinned": p.pinned,
            "mean_active_tps": round(p.mean_active_tps, 2),
            "can_admit": p.capacity.can_admit if p.capacity else None,
        }

    def tps() -> dict[str, Any]:
        t = client.tps()
        return {
            "mean_active_tps": round(t.mean_active_tps, 2),
            "aggregate_tps": round(t.aggregate_tps, 2),
            "sessions": {
                s.session_id or f"slot {s.slot}": round(s.tps_ewma, 2) for s in t.sessions
            },
        }

    def cap(pool: str, expected_tokens: int | None = None) -> dict[str, Any]:
        pool_ref(pool)
        c = client.capacity(pool, expected_tokens)
        return {
            "can_admit": c.can_admit,
            "reason": c.reason_code,
            "headroom_sessions": c.headroom_sessions,
            "mean_active_tps": round(c.mean_active_tps, 2),
        }

    specs: list[tuple[str, str, Callable[..., Any], type[BaseModel]]] = [
        ("create_pool", "Create a root pool: a shared prefix of instructions agents attach to.",
         create, _schema("CreatePool", name=new_name, instructions=text_arg)),
        ("fork_pool", "Fork a pool: a child pool that shares the parent's prefix and adds "
         "instructions, for a group of sub-agents.",
         fork, _schema("ForkPool", parent=pool_arg, name=new_name, instructions=text_arg)),
        ("pool_status", "Status of a pool: prefix length, child pools, sessions, speed.",
         status, _schema("PoolStatus", pool=pool_arg)),
        ("session_tps", "Decode speed (tokens/s) of every session on the engine.",
         tps, _schema("SessionTps")),
        ("capacity", "Can one more agent session join this pool now without slowing the others "
         "under the pool's floor?", cap,
         _schema("Capacity", pool=pool_arg,
                 expected_tokens=(int | None, Field(None, description="tokens it will need")))),
    ]  # fmt: skip
    return [
        StructuredTool.from_function(
            func=_answer(fn), name=name, description=desc, args_schema=schema
        )
        for name, desc, fn, schema in specs
    ]
