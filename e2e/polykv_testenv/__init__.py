"""A real Kubernetes control plane on loopback, and a node that runs pods as processes.

    with ControlPlane(state_dir) as cp, ProcessNode(cp.credentials, node_dir):
        cp.kubectl("apply", "-f", "deploy.yaml")

`polykv-dev up|down|status` runs the same thing in the background for the demo.
"""

from .controlplane import ControlPlane, ControlPlaneError
from .kubeapi import ApiError, Credentials, Kube
from .node import ImageCommand, ImageTable, ProcessNode

__all__ = [
    "ApiError",
    "ControlPlane",
    "ControlPlaneError",
    "Credentials",
    "ImageCommand",
    "ImageTable",
    "Kube",
    "ProcessNode",
]
