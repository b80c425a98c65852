"""Engine refusals are told apart by their reason code, never by their wording.

The engine's messages are for people and change between versions; the operator matches the
`reason` code of the error body (polykv_api.models.Reason) and, for an engine older than
the codes, the HTTP status alone. The last test reads the operator's sources and fails on
any code that inspects the text of an engine's answer.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import httpx
import pytest

from polykv_api import models as wire
from polykv_client import SeqIdsExhausted
from polykv_operator.engine_client import EngineClient, EngineRejected
from polykv_operator.engine_round import rejected_reason

from .fake_engine import FakeEngine

SOURCES = Path(__file__).resolve().parents[2] / "operator" / "polykv_operator"

# Each message is written to lure a substring matcher into another reason's branch.
MISLEADING = "pool already exists, shares no tokens, branch_pos beyond, is taken"


@pytest.mark.parametrize(
    ("reason", "condition"),
    [
        ("prefix_too_long", "PrefixTooLong"),
        ("name_conflict", "NameConflict"),
        ("no_common_prefix", "NoCommonPrefix"),
        ("branch_pos_invalid", "BranchPosInvalid"),
        ("prefix_mismatch", "BranchPosInvalid"),
        ("seq_ids_exhausted", "EngineFull"),
        ("recurrent_branch", "RecurrentBranch"),
        ("prefix_empty", "PrefixRejected"),
        ("template_error", "PrefixRejected"),
    ],
)
def test_the_condition_follows_the_code_whatever_the_message(
    reason: wire.Reason, condition: str
) -> None:
    exc = EngineRejected(409, MISLEADING, "conflict_error", reason)
    failure = rejected_reason(exc, "pod-a", "x")
    assert failure.reason == condition
    assert MISLEADING in failure.message  # the engine's words are passed on, for people


def test_every_code_the_round_names_is_a_code_the_engine_has() -> None:
    tree = ast.parse((SOURCES / "engine_round.py").read_text())
    fn = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "rejected_reason"
    )
    named = {
        p.value.value
        for p in ast.walk(fn)
        if isinstance(p, ast.MatchValue) and isinstance(p.value, ast.Constant)
    }
    assert named and named <= set(wire.REASONS), named - set(wire.REASONS)


@pytest.mark.parametrize(
    ("status", "etype", "reason"),
    [
        (404, "not_found_error", "pool_not_found"),
        (400, "exceed_context_size_error", "invalid_request"),
        (409, "capacity_error", None),  # a 409 has several meanings: the type is not read
    ],
)
def test_an_older_engine_is_read_by_its_status_only(
    status: int, etype: str, reason: str | None
) -> None:
    exc = EngineRejected(status, "no free pool sequence id; already exists", etype)
    assert exc.reason == reason
    assert rejected_reason(exc, "pod-a", "x").reason == "PrefixRejected"


def test_an_unknown_code_falls_back_to_the_status() -> None:
    assert EngineRejected(404, "m", "t", "a_code_from_the_future").reason == "pool_not_found"
    assert EngineRejected(409, "m", "t", "a_code_from_the_future").reason is None


def client(eng: FakeEngine) -> EngineClient:
    return EngineClient(httpx.AsyncClient(transport=httpx.MockTransport(eng)), "http://e", "k")


@pytest.mark.parametrize("reasons", [True, False])
def test_release_of_an_absent_pool_is_not_an_error(reasons: bool) -> None:
    assert asyncio.run(client(FakeEngine(reasons=reasons)).release("ghost")) is False


def test_the_client_reads_the_code_from_the_body() -> None:
    eng = FakeEngine(max_pools=0)
    req = wire.PoolCreateRequest(name="root", prompt="hello")
    with pytest.raises(EngineRejected) as info:
        asyncio.run(client(eng).create(None, req))
    assert info.value.reason == "seq_ids_exhausted"
    assert isinstance(info.value, SeqIdsExhausted)
    old = FakeEngine(max_pools=0, reasons=False)
    with pytest.raises(EngineRejected) as info:
        asyncio.run(client(old).create(None, req))
    assert info.value.reason is None and not isinstance(info.value, SeqIdsExhausted)


# -- no module reads the engine's wording --------------------------------------------------

ENGINE_TEXT = {"message", "error"}  # EngineRejected.message; Observation.error, CreateError...
TEXT_METHODS = {"startswith", "endswith", "find", "rfind", "index", "count", "__contains__"}
REGEX = {"search", "match", "fullmatch", "findall", "finditer"}


def _text_names(fn: ast.AST) -> set[str]:
    """Local names bound to engine text in `fn`: `msg = exc.message`, `err = str(exc)`."""
    out: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and _is_text(node.value, set()):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def _is_text(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Attribute) and node.attr in ENGINE_TEXT:
        return True
    if isinstance(node, ast.Name) and node.id in names:
        return True
    # str(exc), f"{exc}": an exception's text is the engine's message
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "str"
        and bool(node.args)
    )


def text_matches(source: str) -> list[int]:
    """Lines that test engine text: `"x" in msg`, `msg == "x"`, `msg.startswith(...)`,
    `re.search(..., msg)`."""
    tree = ast.parse(source)
    hits: list[int] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        names = _text_names(fn)
        for node in ast.walk(fn):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                for op, right in zip(node.ops, node.comparators, strict=True):
                    if isinstance(op, ast.In | ast.NotIn) and _is_text(right, names):
                        hits.append(node.lineno)
                    if (
                        isinstance(op, ast.Eq | ast.NotEq)
                        and any(_is_text(s, names) for s in sides)
                        and any(
                            isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides
                        )
                    ):
                        hits.append(node.lineno)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                attr = node.func
                if attr.attr in TEXT_METHODS and _is_text(attr.value, names):
                    hits.append(node.lineno)
                if attr.attr in REGEX and any(_is_text(a, names) for a in node.args):
                    hits.append(node.lineno)
    return sorted(set(hits))


def test_the_scan_catches_what_it_is_for() -> None:
    caught = """
def a(exc):
    msg = exc.message
    if "already exists" in msg:
        return 1
    if exc.message.startswith("pool"):
        return 2
    if re.search("full", str(exc)):
        return 3
    if obs.error == "timeout":
        return 4
"""
    assert text_matches(caught) == [4, 6, 8, 10]
    fine = """
def b(exc, record):
    msg = record.getMessage()
    if msg.startswith("Timer "):
        return exc.reason == "name_conflict"
    return f"replica: {exc.message}"
"""
    assert text_matches(fine) == []


def test_no_operator_module_matches_engine_text() -> None:
    found = {
        str(p.relative_to(SOURCES)): lines
        for p in sorted(SOURCES.rglob("*.py"))
        if (lines := text_matches(p.read_text()))
    }
    assert found == {}, f"match the engine's reason code, not its message text: {found}"
