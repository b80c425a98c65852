"""``polykv-operator``: ``kopf run`` with the operator's handlers.

    polykv-operator --all-namespaces            # in a cluster (the Deployment runs this)
    polykv-operator --namespace agents --verbose

Every argument is passed to ``kopf run``. Without ``--peering NAME`` (or ``--peering=NAME``)
``--standalone`` is added: one replica acts alone and needs no peering objects. With it, the
replicas exchange keep-alives through kopf's peering object and only one acts.
"""

from __future__ import annotations

import sys


def argv(args: list[str]) -> list[str]:
    chosen = any(a in ("--standalone", "--peering") or a.startswith("--peering=") for a in args)
    extra = [] if chosen else ["--standalone"]
    return ["kopf", "run", *extra, *args, "-m", "polykv_operator.main"]


def main() -> None:
    from kopf.cli import main as kopf_main

    sys.argv = argv(sys.argv[1:])
    kopf_main()


if __name__ == "__main__":
    main()
