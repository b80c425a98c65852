"""One real control plane and process node for the whole session (see polykv_testenv),
shared by both folders: harness/ tests the local cluster itself (API server, node, pods,
garbage collection, kopf runner, Helm); polykv/ runs the engine and the operator on it.
helpers.py, beside this file, serves both (`from ..helpers import ...`)."""

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
