"""One real control plane and process node for the whole session (see polykv_testenv)."""

from polykv_testenv.fixtures import (
    k8s_cluster,
    namespace,
    process_node,
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
    run_operator,
)

__all__ = [
    "k8s_cluster",
    "namespace",
    "process_node",
    "pytest_collection_modifyitems",
    "pytest_runtest_makereport",
    "run_operator",
]
