"""The declared pool tree of one namespace, as pure functions.

Input: the PolyKVPool objects (from the operator's index). Output: for each pool, either a
problem that says what to fix, or its chain from the root, its path and depth, the exact
engine request that materializes it on a replica, and the ownerReference that ties it to
its parent. Nothing here talks to an engine or to the API server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from polykv_api import models as wire

from .api import API_VERSION, POOL, PolyKVPoolSpec

TEXT_SOURCES = ("text", "appendText")
MESSAGE_SOURCES = ("messages", "appendMessages")


@dataclass(frozen=True)
class PoolNode:
    """A PolyKVPool as the operator indexes it."""

    namespace: str
    name: str
    uid: str
    spec: PolyKVPoolSpec
    labels: Mapping[str, str] = field(default_factory=dict)
    generation: int = 1
    deleting: bool = False
    # The object's status and version as last seen (the engine loop diffs against them).
    # The version takes part in equality: kopf keeps an index entry that compares equal to
    # the new one, and a status-only change would otherwise never reach the index.
    status: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    resource_version: str = ""

    @property
    def engine(self) -> str:
        return self.spec.engine_ref.name

    @property
    def parent(self) -> str | None:
        return self.spec.parent


@dataclass(frozen=True)
class Problem:
    """Why a pool cannot be materialized. `stalled`: it needs a person (kstatus Stalled);
    otherwise it is waiting for something that is on its way (Reconciling)."""

    reason: str
    message: str
    stalled: bool = True


def by_name(nodes: Iterable[PoolNode]) -> dict[str, PoolNode]:
    return {n.name: n for n in nodes}


def chain(node: PoolNode, pools: Mapping[str, PoolNode]) -> list[PoolNode] | Problem:
    """Root first, `node` last; or the first problem met walking up the parents."""
    out = [node]
    seen = {node.name}
    current = node
    while current.parent is not None:
        parent = pools.get(current.parent)
        if parent is None:
            return Problem(
                "ParentNotFound",
                f'pool "{current.parent}" does not exist in namespace {node.namespace}; '
                "create it or fix spec.parent"
                + ("" if current is node else f' (an ancestor of "{node.name}")'),
            )
        if parent.name in seen:
            loop = " -> ".join([n.name for n in out] + [parent.name])
            return Problem("ParentCycle", f"spec.parent forms a cycle: {loop}")
        if parent.engine != current.engine:
            return Problem(
                "ParentEngineMismatch",
                f'parent "{parent.name}" is on engine "{parent.engine}" but "{current.name}" '
                f'is on "{current.engine}"; a pool and its parent must share an engine',
            )
        seen.add(parent.name)
        out.append(parent)
        current = parent
    out.reverse()
    return out


def check(
    node: PoolNode, pools: Mapping[str, PoolNode], engines: Iterable[str]
) -> list[PoolNode] | Problem:
    """Every check that needs no engine: the engine exists, the parent chain is sound, an
    append extends a parent of the same kind. Returns the chain when all hold."""
    if node.engine not in set(engines):
        return Problem(
            "EngineNotFound",
            f'engine "{node.engine}" does not exist in namespace {node.namespace}; create the '
            "PolyKVEngine or fix spec.engineRef.name",
        )
    found = chain(node, pools)
    if isinstance(found, Problem):
        return found
    source = node.spec.source()
    if source in ("appendText", "appendMessages"):
        parent = found[-2]
        kinds = TEXT_SOURCES if source == "appendText" else MESSAGE_SOURCES
        if parent.spec.source() not in kinds:
            want = "text" if source == "appendText" else "chat messages"
            return Problem(
                "AppendMismatch",
                f'{source} extends a parent made of {want}, but parent "{parent.name}" is given '
                f"as {parent.spec.source()}; give this pool's full prefix instead",
            )
    for ancestor in found[:-1]:
        if ancestor.deleting:
            return Problem(
                "ParentDeleting",
                f'ancestor "{ancestor.name}" is being deleted; this pool goes with it',
                stalled=False,
            )
    return found


def path_of(found: Sequence[PoolNode]) -> str:
    return "/".join(n.name for n in found)


def _full_text(found: Sequence[PoolNode]) -> str:
    parts: list[str] = []
    for n in found:
        if n.spec.text is not None:
            parts = [n.spec.text]
        elif n.spec.append_text is not None:
            parts.append(n.spec.append_text)
    return "".join(parts)


def _full_messages(found: Sequence[PoolNode]) -> tuple[list[dict[str, Any]], Any]:
    messages: list[dict[str, Any]] = []
    tools: Any = None
    for n in found:
        if n.spec.messages is not None:
            messages = [m.to_engine() for m in n.spec.messages]
            tools = n.spec.tools
        elif n.spec.append_messages is not None:
            messages += [m.to_engine() for m in n.spec.append_messages]
    return messages, tools


PoolRequest = wire.PoolCreateRequest | wire.PoolForkRequest


def request_body(found: Sequence[PoolNode], dry_run: bool = False) -> PoolRequest:
    """The engine request that creates `found[-1]` (POST /polykv/pools for a root, else
    POST /polykv/pools/{parent}/fork): the FULL prefix, the resource name as the pool name
    (so a retried create is a no-op) and branch_pos only when the user gave one."""
    node = found[-1]
    spec = node.spec
    source = spec.source()
    prefix: dict[str, Any] = {}
    if source in TEXT_SOURCES:
        prefix["prompt"] = _full_text(found)
    elif source in MESSAGE_SOURCES:
        messages, tools = _full_messages(found)
        prefix["messages"] = messages
        if tools is not None:
            prefix["tools"] = tools
    else:
        prefix["tokens"] = list(spec.tokens or [])
    common = {"name": node.name, "pin": spec.pin, "dry_run": dry_run, **prefix}
    # Validated against the wire contract here, so a bad body fails in the operator's tests.
    if node.parent is None:
        return wire.PoolCreateRequest.model_validate(common)
    return wire.PoolForkRequest.model_validate({**common, "branch_pos": spec.branch_pos})


def parent_owner_reference(parent: PoolNode) -> dict[str, Any]:
    """The ownerReference a child pool carries: the garbage collector removes a tree with
    its root, and tools that follow ownerReferences show the tree. Not a controller
    reference: the operator, not the parent, reconciles the child."""
    return {
        "apiVersion": API_VERSION,
        "kind": POOL.kind,
        "name": parent.name,
        "uid": parent.uid,
        "controller": False,
        "blockOwnerDeletion": True,
    }


def parents_first(nodes: Iterable[PoolNode], pools: Mapping[str, PoolNode]) -> list[PoolNode]:
    """Nodes sorted so that every parent precedes its children (by depth, then name)."""

    def depth(n: PoolNode) -> int:
        found = chain(n, pools)
        return len(found) - 1 if not isinstance(found, Problem) else 0

    return sorted(nodes, key=lambda n: (depth(n), n.name))


def children_of(name: str, nodes: Iterable[PoolNode]) -> list[PoolNode]:
    return sorted((n for n in nodes if n.parent == name), key=lambda n: n.name)
