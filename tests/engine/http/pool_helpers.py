"""Helpers for pool tests: calls, and the KV accounting identity checked against llama.cpp."""

from __future__ import annotations

from typing import Any

import httpx

ADMIN = {"Authorization": "Bearer admin-key"}


def listing(c: httpx.Client) -> dict[str, Any]:
    r = c.get("/polykv/pools", headers=ADMIN)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def check_accounting(c: httpx.Client) -> dict[str, Any]:
    """Σ own + Σ session marginal == bytes in use, and the shadow count == llama.cpp's."""
    lst = listing(c)
    bpt = lst["kv_bytes_per_token"]
    own = sum(p["own_kv_bytes"] for p in lst["pools"])
    sessions = sum(s["marginal_kv_bytes"] for p in lst["pools"] for s in p["sessions"])
    sessions += sum(s["marginal_kv_bytes"] for s in lst["unpooled_sessions"])
    assert own + sessions == lst["kv_bytes_used"] == lst["kv_cells_used"] * bpt, lst
    assert lst["kv_cells_measured"] == lst["kv_cells_used"], (
        f"shadow model says {lst['kv_cells_used']} cells, llama.cpp {lst['kv_cells_measured']}"
    )
    by_id = {p["pool_id"]: p for p in lst["pools"]}
    for p in lst["pools"]:
        if p["parent"] is not None:
            parent = by_id[p["parent"]]
            assert p["pool_id"] in parent["children"]
            assert 0 < p["branch_pos"] <= parent["prefix_len"]
            assert p["depth"] == parent["depth"] + 1
        kids = sum(by_id[k]["subtree_kv_bytes"] for k in p["children"])
        marg = sum(s["marginal_kv_bytes"] for s in p["sessions"])
        assert p["subtree_kv_bytes"] == p["own_kv_bytes"] + kids + marg
    return lst


def create(c: httpx.Client, expect: int = 201, **body: Any) -> dict[str, Any]:
    r = c.post("/polykv/pools", json=body, headers=ADMIN)
    assert r.status_code == expect, r.text
    out: dict[str, Any] = r.json()
    return out


def fork(c: httpx.Client, parent: int | str, expect: int = 201, **body: Any) -> dict[str, Any]:
    r = c.post(f"/polykv/pools/{parent}/fork", json=body, headers=ADMIN)
    assert r.status_code == expect, r.text
    out: dict[str, Any] = r.json()
    return out


def tokenize(c: httpx.Client, text: str, add_special: bool = True) -> list[int]:
    toks: list[int] = c.post(
        "/tokenize", json={"content": text, "add_special": add_special}, headers=ADMIN
    ).json()["tokens"]
    return toks


def complete(c: httpx.Client, prompt: Any, n: int = 24, **extra: Any) -> httpx.Response:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, **extra}
    return c.post("/completion", json=body, headers=ADMIN)


def release_all(c: httpx.Client) -> None:
    """Delete every pool, leaves first."""
    for p in sorted(listing(c)["pools"], key=lambda p: -p["depth"]):
        r = c.delete(f"/polykv/pools/{p['pool_id']}", headers=ADMIN)
        assert r.status_code == 200, r.text
