"""Pool tree checks and engine request bodies (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from polykv_api import models as wire
from polykv_operator.tree import (
    PoolNode,
    Problem,
    check,
    parent_owner_reference,
    parents_first,
    path_of,
    request_body,
)

from .builders import pool

ENGINES = ["eng", "other"]
SYS = {"role": "system", "content": "You are the crew."}
TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}


def index(*nodes):  # type: ignore[no-untyped-def]
    return {n.name: n for n in nodes}


def problem(node, pools, engines=ENGINES) -> Problem:  # type: ignore[no-untyped-def]
    got = check(node, pools, engines)
    assert isinstance(got, Problem), got
    return got


def test_root_chain_path_and_depth() -> None:
    root = pool("root")
    child = pool("child", parent="root")
    grand = pool("grand", parent="child")
    found = check(grand, index(root, child, grand), ENGINES)
    assert not isinstance(found, Problem)
    assert [n.name for n in found] == ["root", "child", "grand"]
    assert path_of(found) == "root/child/grand"


def test_unknown_engine_names_engine_and_namespace() -> None:
    p = problem(pool("p", engine="ghost"), index(pool("p", engine="ghost")))
    assert p.reason == "EngineNotFound" and p.stalled
    assert '"ghost"' in p.message and "agents" in p.message and "engineRef" in p.message


def test_missing_parent_names_it() -> None:
    node = pool("p", parent="agent-rot")
    p = problem(node, index(node))
    assert p.reason == "ParentNotFound"
    assert p.message.startswith('pool "agent-rot" does not exist in namespace agents')


def test_missing_grandparent_is_reported_on_the_grandchild_too() -> None:
    child, grand = pool("child", parent="gone"), pool("grand", parent="child")
    p = problem(grand, index(child, grand))
    assert p.reason == "ParentNotFound" and "ancestor" in p.message


def test_cycle() -> None:
    a, b = pool("a", parent="b"), pool("b", parent="a")
    p = problem(a, index(a, b))
    assert p.reason == "ParentCycle" and "a -> b -> a" in p.message


def test_parent_on_another_engine() -> None:
    root, child = pool("root", engine="other"), pool("child", parent="root")
    assert problem(child, index(root, child)).reason == "ParentEngineMismatch"


def test_append_must_match_the_parent_kind() -> None:
    root = pool("root", text="hello")
    child = pool("child", parent="root", appendMessages=[SYS])
    p = problem(child, index(root, child))
    assert p.reason == "AppendMismatch" and "full prefix" in p.message


def test_deleting_ancestor_makes_children_wait_not_stall() -> None:
    root, child = pool("root", deleting=True), pool("child", parent="root", appendText="x")
    p = problem(child, index(root, child))
    assert p.reason == "ParentDeleting" and not p.stalled


def sent(found: list[PoolNode], dry_run: bool = False) -> dict[str, Any]:
    """The JSON the engine client sends for `request_body(found)`."""
    return request_body(found, dry_run=dry_run).model_dump(mode="json", exclude_none=True)


def test_text_root_body() -> None:
    root = pool("root", text="hello", pin=True)
    assert isinstance(request_body([root]), wire.PoolCreateRequest)
    assert sent([root]) == {
        "prompt": "hello",
        "name": "root",
        "pin": True,
        "dry_run": False,
    }


def test_append_text_is_the_full_prefix_and_branch_pos_is_left_to_the_engine() -> None:
    root = pool("root", text="hello")
    child = pool("child", parent="root", appendText=" world")
    grand = pool("grand", parent="child", appendText="!")
    assert isinstance(request_body([root, child, grand]), wire.PoolForkRequest)
    body = sent([root, child, grand], dry_run=True)
    assert body["prompt"] == "hello world!"
    assert body["dry_run"] is True
    assert "branch_pos" not in body


def test_append_messages_inherit_the_roots_tools() -> None:
    root = pool("root", messages=[SYS], tools=[TOOL])
    user = {"role": "user", "content": "Brief."}
    child = pool("child", parent="root", appendMessages=[user])
    body = sent([root, child])
    assert body["messages"] == [SYS, user]
    assert body["tools"] == [TOOL]


def test_full_messages_child_keeps_its_own_tools_and_branch_pos() -> None:
    root = pool("root", messages=[SYS], tools=[TOOL])
    other = {"role": "system", "content": "You are the shell crew."}
    child = pool("child", parent="root", messages=[other], branchPos=3)
    body = sent([root, child])
    assert body["messages"] == [other] and "tools" not in body
    assert body["branch_pos"] == 3


def test_tokens_body() -> None:
    assert sent([pool("t", tokens=[1, 2, 3])])["tokens"] == [1, 2, 3]


def test_parent_owner_reference_is_not_a_controller() -> None:
    ref = parent_owner_reference(pool("root"))
    assert ref == {
        "apiVersion": "polykv.io/v1alpha1",
        "kind": "PolyKVPool",
        "name": "root",
        "uid": "uid-root",
        "controller": False,
        "blockOwnerDeletion": True,
    }


def test_parents_first() -> None:
    nodes = [pool("z", parent="a"), pool("b", parent="z"), pool("a")]
    assert [n.name for n in parents_first(nodes, index(*nodes))] == ["a", "z", "b"]


def test_spec_needs_exactly_one_source() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        pool("x", text="a", tokens=[1]).spec.source()


def test_a_newer_version_of_a_pool_is_not_equal_to_the_old_one() -> None:
    """kopf keeps an index entry equal to the new one: a status-only change (a new
    resourceVersion) must make the entry differ, or the loop never sees that status."""
    from dataclasses import replace

    old = replace(pool("root"), status={"path": "root"}, resource_version="1")
    assert replace(old, status={"path": "elsewhere"}, resource_version="2") != old
