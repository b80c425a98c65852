"""``kubectl polykv tree [-n NS | -A]``: the pool tree from the PolyKVPools' statuses.

Installed as the console script ``kubectl-polykv``; kubectl runs any ``kubectl-<name>`` on
PATH as ``kubectl <name>``. One list call, no engine calls: every figure is what the
operator last wrote to status.

    POOL              LEN   D     SESSIONS   TPS    KV        READY
    crew              201   0     0          -      4.9 MiB   True
    ├── planner       239   201   1          31.2   0.9 MiB   True
    └── shell-crew    212   29    0          -      4.4 MiB   True

LEN is the prefix length in tokens, D where it leaves its parent (branchPos), KV the bytes
of its own range [D, LEN) over all replicas; READY is the Ready condition, or the Stalled
reason when there is one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from .api import GROUP, POOL, VERSION

Obj = dict[str, Any]

HEADER = ("POOL", "LEN", "D", "SESSIONS", "TPS", "KV", "READY")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def readiness(obj: Obj) -> str:
    conditions = {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []}
    stalled = conditions.get("Stalled")
    if stalled is not None and stalled.get("status") == "True":
        return f"Stalled: {stalled.get('reason', '')}"
    if obj["metadata"].get("deletionTimestamp"):
        return "Deleting"
    ready = conditions.get("Ready")
    if ready is None:
        return "-"
    if ready.get("status") == "True":
        return "True"
    return f"{ready.get('status')}: {ready.get('reason', '')}"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def row(obj: Obj) -> list[str]:
    st = obj.get("status") or {}
    return [
        _cell(st.get("prefixLen")),
        _cell(st.get("branchPos")),
        _cell(st.get("sessions")),
        _cell(st.get("meanActiveTps")),
        human_bytes(st.get("ownKvBytes")),
        readiness(obj),
    ]


def tree_lines(pools: Sequence[Obj]) -> list[tuple[str, list[str]]]:
    """(the name with its branch lines, the other columns), parents before children, siblings
    by name. A pool whose parent is not in the list is drawn as a root, marked."""
    by_name = {p["metadata"]["name"]: p for p in pools}
    children: dict[str | None, list[Obj]] = {}
    for p in pools:
        parent = (p.get("spec") or {}).get("parent")
        children.setdefault(parent if parent in by_name else None, []).append(p)
    out: list[tuple[str, list[str]]] = []

    def walk(node: Obj, prefix: str, connector: str, seen: frozenset[str]) -> None:
        name = node["metadata"]["name"]
        parent = (node.get("spec") or {}).get("parent")
        label = name if not (connector == "" and parent) else f"{name} (parent {parent} missing)"
        out.append((prefix + connector + label, row(node)))
        kids = sorted(children.get(name, []), key=lambda p: p["metadata"]["name"])
        below = prefix + ("" if connector == "" else ("    " if connector == "└── " else "│   "))
        for i, kid in enumerate(kids):
            if kid["metadata"]["name"] in seen:  # a cycle (the operator stalls it): stop
                continue
            last = i == len(kids) - 1
            walk(kid, below, "└── " if last else "├── ", seen | {name})

    for root in sorted(children.get(None, []), key=lambda p: p["metadata"]["name"]):
        walk(root, "", "", frozenset())
    return out


def render(pools: Sequence[Obj]) -> str:
    lines = [(HEADER[0], list(HEADER[1:])), *tree_lines(pools)]
    widths = [max(len(name) for name, _ in lines)]
    for col in range(len(HEADER) - 1):
        widths.append(max(len(cols[col]) for _, cols in lines))
    text = []
    for name, cols in lines:
        padded = (c.ljust(w) for c, w in zip(cols, widths[1:], strict=True))
        cells = [name.ljust(widths[0]), *padded]
        text.append("   ".join(cells).rstrip())
    return "\n".join(text)


def list_pools(namespace: str | None) -> list[Obj]:
    from kubernetes import client
    from kubernetes import config as kube_config

    config: Any = kube_config  # untyped package
    config.load_kube_config()
    api: Any = client.CustomObjectsApi()
    if namespace is None:
        items: list[Obj] = api.list_cluster_custom_object(GROUP, VERSION, POOL.plural)["items"]
    else:
        items = api.list_namespaced_custom_object(GROUP, VERSION, namespace, POOL.plural)["items"]
    return items


def current_namespace() -> str:
    from kubernetes import config as kube_config

    config: Any = kube_config
    _, active = config.list_kube_config_contexts()
    return str((active or {}).get("context", {}).get("namespace") or "default")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kubectl polykv", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tree", help="draw the pool tree")
    where = t.add_mutually_exclusive_group()
    where.add_argument("-n", "--namespace", help="namespace (default: the context's)")
    where.add_argument("-A", "--all-namespaces", action="store_true")
    args = p.parse_args(argv)
    if args.all_namespaces:
        pools = list_pools(None)
        namespaces = sorted({x["metadata"]["namespace"] for x in pools})
        blocks = [
            f"NAMESPACE {ns}\n" + render([x for x in pools if x["metadata"]["namespace"] == ns])
            for ns in namespaces
        ]
        print("\n\n".join(blocks) if blocks else "No PolyKVPools found.")
        return 0
    namespace = args.namespace or current_namespace()
    pools = list_pools(namespace)
    print(render(pools) if pools else f"No PolyKVPools in namespace {namespace}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
