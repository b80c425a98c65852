"""A PersistentVolumeClaim bound to a volume, as a provisioner would leave it.

This control plane runs no volume controllers: the binding is written by hand, and the
protection finalizers are left out (nothing would ever remove them). The process node keeps
a claim's files in a directory of its own that outlives the pods using it.
"""

from __future__ import annotations

from .controlplane import ControlPlane


def bind_claim(cluster: ControlPlane, namespace: str, claim: str, size: str = "1Gi") -> str:
    """Creates the claim and its volume; returns the volume's name (cluster-scoped: the
    caller deletes it when its namespace goes)."""
    pv = f"{claim}-{namespace}"
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadWriteOnce"],
                "hostPath": {"path": f"/tmp/{pv}"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        }
    )
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {
                "name": claim,
                "annotations": {"pv.kubernetes.io/bind-completed": "yes"},
            },
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": size}},
                "volumeName": pv,
            },
        },
        namespace,
    )
    unprotected = ("-p", '{"metadata":{"finalizers":null}}', "--type=merge")
    cluster.kubectl("patch", "pv", pv, *unprotected)
    cluster.kubectl("patch", "pvc", claim, "-n", namespace, *unprotected)
    return pv
