"""``polykv-operator``: ``kopf run`` with the operator's handlers.

    polykv-operator --all-namespaces            # in a cluster (the Deployment runs this)
    polykv-operator --namespace agents --verbose

Every argument is passed to ``kopf run``; ``--standalone`` is added because the operator runs
as a single replica (Deployment strategy Recreate), so kopf's peering objects are not needed.
"""

from __future__ import annotations

import sys


def argv(args: list[str]) -> list[str]:
    peering = any(a == "--peering" or a.startswith("--peering=") for a in args)
    extra = [] if "--standalone" in args or peering else ["--standalone"]
    return ["kopf", "run", *extra, *args, "-m", "polykv_operator.main"]


def main() -> None:
    from kopf.cli import main as kopf_main

    sys.argv = argv(sys.argv[1:])
    kopf_main()


if __name__ == "__main__":
    main()
