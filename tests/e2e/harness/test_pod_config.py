"""How the process node turns a pod spec into a process: env, volumes, exits, bad images."""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx
import pytest

from polykv_testenv import ControlPlane, ProcessNode

from ..helpers import Obj, eventually, fetch_if, is_ready, web_container

pytestmark = pytest.mark.k8s


def served(ip: str, path: str) -> Obj:
    body: Obj = httpx.get(f"http://{ip}:8080{path}", timeout=5).json()
    return body


def test_env_and_volumes_resolve_to_local_values(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str, tmp_path: Path
) -> None:
    api = k8s_cluster.api
    ns_api = f"/api/v1/namespaces/{namespace}"
    api.create(f"{ns_api}/configmaps", {"metadata": {"name": "conf"}, "data": {"msg": "hello"}})
    api.create(f"{ns_api}/secrets", {"metadata": {"name": "creds"}, "stringData": {"token": "t0k"}})
    (tmp_path / "host.txt").write_text("from the host")

    container = web_container("--serve-file", "/etc/conf/msg")
    container["env"] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {
            "name": "TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}},
        },
        {"name": "GREETING", "value": "hi $(POD_NAME)"},
        {"name": "HOST_FILE", "value": "/mnt/host/host.txt"},
    ]
    container["volumeMounts"] = [
        {"name": "conf", "mountPath": "/etc/conf"},
        {"name": "host", "mountPath": "/mnt/host"},
        {"name": "scratch", "mountPath": "/scratch"},
    ]
    pod: Obj = {
        "metadata": {"name": "configured"},
        "spec": {
            "containers": [container],
            "volumes": [
                {"name": "conf", "configMap": {"name": "conf"}},
                {"name": "host", "hostPath": {"path": str(tmp_path)}},
                {"name": "scratch", "emptyDir": {}},
            ],
        },
    }
    api.create(f"{ns_api}/pods", pod)
    got = eventually("pod Ready", lambda: fetch_if(api, f"{ns_api}/pods/configured", is_ready))
    ip = got["status"]["podIP"]

    # The path argument now names the ConfigMap's file in a local directory.
    file = served(ip, "/served")
    assert file["content"] == "hello"
    assert not file["path"].startswith("/etc/conf")
    assert served(ip, "/env/POD_NAME")["value"] == "configured"
    assert served(ip, "/env/POD_IP")["value"] == ip
    assert served(ip, "/env/TOKEN")["value"] == "t0k"
    assert served(ip, "/env/GREETING")["value"] == "hi configured"
    host_file = served(ip, "/env/HOST_FILE")["value"]
    assert host_file == str(tmp_path / "host.txt")
    assert served(ip, f"/file{host_file}")["content"] == "from the host"


def one_shot(name: str, code: int) -> Obj:
    return {
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "job",
                    "image": "polykv/testserver:1",
                    # `command` replaces the image's entrypoint, as with a real image.
                    "command": ["python", "-c", f"raise SystemExit({code})"],
                }
            ],
        },
    }


def test_run_to_completion_and_failure(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str
) -> None:
    api = k8s_cluster.api
    pods = f"/api/v1/namespaces/{namespace}/pods"
    api.create(pods, one_shot("ok", 0))
    api.create(pods, one_shot("bad", 3))

    def phase(name: str, want: str) -> Obj | None:
        p = api.get(f"{pods}/{name}")
        return p if p["status"].get("phase") == want else None

    ok = eventually("ok Succeeded", lambda: phase("ok", "Succeeded"))
    term = ok["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 0 and term["reason"] == "Completed"
    bad = eventually("bad Failed", lambda: phase("bad", "Failed"))
    term = bad["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 3 and term["reason"] == "Error"
    assert bad["status"]["containerStatuses"][0]["restartCount"] == 0


def test_unknown_image_waits_with_err_image_pull(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str
) -> None:
    api = k8s_cluster.api
    pods = f"/api/v1/namespaces/{namespace}/pods"
    api.create(
        pods,
        {"metadata": {"name": "nope"}, "spec": {"containers": [{"name": "c", "image": "nginx"}]}},
    )

    def waiting_reason() -> str | None:
        statuses = api.get(f"{pods}/nope")["status"].get("containerStatuses") or []
        waiting = statuses[0]["state"].get("waiting", {}) if statuses else {}
        return waiting.get("reason") if waiting.get("reason") == "ErrImagePull" else None

    assert eventually("ErrImagePull", waiting_reason) == "ErrImagePull"
    assert api.get(f"{pods}/nope")["status"]["phase"] == "Pending"


def test_init_container_runs_first_and_shares_an_empty_dir(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str
) -> None:
    api = k8s_cluster.api
    main = web_container("--serve-file", "/shared/greeting")
    main["volumeMounts"] = [{"name": "shared", "mountPath": "/shared"}]
    pod: Obj = {
        "metadata": {"name": "init"},
        "spec": {
            "initContainers": [
                {
                    "name": "prepare",
                    "image": "polykv/testserver:1",
                    "command": ["python", "-c"],
                    # The mount path inside the script is rewritten like any argument.
                    "args": ["open('/shared/greeting', 'w').write('prepared')"],
                    "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
                }
            ],
            "containers": [main],
            "volumes": [{"name": "shared", "emptyDir": {}}],
        },
    }
    path = f"/api/v1/namespaces/{namespace}/pods/init"
    api.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    got = eventually("pod Ready", lambda: fetch_if(api, path, is_ready))
    init_state = got["status"]["initContainerStatuses"][0]["state"]["terminated"]
    assert init_state["exitCode"] == 0
    assert served(got["status"]["podIP"], "/served")["content"] == "prepared"


def test_failing_liveness_probe_restarts_the_container(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str
) -> None:
    api = k8s_cluster.api
    container = web_container()
    container["livenessProbe"] = {
        "httpGet": {"path": "/env/UNSET_VARIABLE", "port": "http"},  # 404
        "periodSeconds": 1,
        "failureThreshold": 2,
    }
    pod: Obj = {
        "metadata": {"name": "unhealthy"},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [container]},
    }
    path = f"/api/v1/namespaces/{namespace}/pods/unhealthy"
    api.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    got = eventually(
        "restarted by the liveness probe",
        lambda: fetch_if(api, path, lambda p: p["status"]["containerStatuses"][0]["restartCount"]),
    )
    last = got["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert "Liveness probe failed" in last["message"]


def test_a_pod_talks_to_the_api_server_as_its_service_account(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str
) -> None:
    """What the kubelet's token mount gives a container: a KUBECONFIG holding a token bound
    to the pod, for the pod's ServiceAccount (so RBAC applies to it). A pod that opts out
    gets none."""
    api = k8s_cluster.api
    ns_api = f"/api/v1/namespaces/{namespace}"
    api.create(f"{ns_api}/serviceaccounts", {"metadata": {"name": "robot"}})
    for name, automount in (("with-token", True), ("without-token", False)):
        pod: Obj = {
            "metadata": {"name": name},
            "spec": {
                "serviceAccountName": "robot",
                "automountServiceAccountToken": automount,
                "containers": [web_container()],
            },
        }
        api.create(f"{ns_api}/pods", pod)
    got = eventually("pod Ready", lambda: fetch_if(api, f"{ns_api}/pods/with-token", is_ready))
    kubeconfig = Path(served(got["status"]["podIP"], "/env/KUBECONFIG")["value"])
    token = (kubeconfig.parent / "token").read_text()
    review = httpx.post(
        f"{k8s_cluster.credentials.server}/apis/authentication.k8s.io/v1/selfsubjectreviews",
        json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        headers={"Authorization": f"Bearer {token}"},
        verify=ssl.create_default_context(cafile=str(k8s_cluster.credentials.ca_file)),
        timeout=10,
    ).json()
    user = review["status"]["userInfo"]
    assert user["username"] == f"system:serviceaccount:{namespace}:robot"
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == ["with-token"]

    other = eventually("pod Ready", lambda: fetch_if(api, f"{ns_api}/pods/without-token", is_ready))
    r = httpx.get(f"http://{other['status']['podIP']}:8080/env/KUBECONFIG", timeout=5)
    assert r.status_code == 404


SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def test_a_projected_service_account_token_authenticates_as_the_pod(
    k8s_cluster: ControlPlane, process_node: ProcessNode, namespace: str
) -> None:
    """A projected volume with a serviceAccountToken, the cluster CA and the namespace, as
    an in-cluster client (polykv-router) reads them: the token is the pod's own."""
    api = k8s_cluster.api
    ns_api = f"/api/v1/namespaces/{namespace}"
    container = web_container()
    container["env"] = [{"name": "SA_DIR", "value": SA_DIR}]
    container["volumeMounts"] = [{"name": "kube-api-access", "mountPath": SA_DIR}]
    namespace_item = {"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}
    volume = {
        "name": "kube-api-access",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {
                    "configMap": {
                        "name": "kube-root-ca.crt",
                        "items": [{"key": "ca.crt", "path": "ca.crt"}],
                    }
                },
                {"downwardAPI": {"items": [namespace_item]}},
            ]
        },
    }
    pod: Obj = {
        "metadata": {"name": "in-cluster"},
        "spec": {"serviceAccountName": "default", "containers": [container], "volumes": [volume]},
    }
    api.create(f"{ns_api}/pods", pod)
    got = eventually("pod Ready", lambda: fetch_if(api, f"{ns_api}/pods/in-cluster", is_ready))
    ip = got["status"]["podIP"]
    sa_dir = served(ip, "/env/SA_DIR")["value"]
    assert sa_dir != SA_DIR  # rewritten to the volume's local directory
    assert served(ip, f"/file{sa_dir}/namespace")["content"] == namespace
    ca = Path(sa_dir) / "ca.crt"
    token = served(ip, f"/file{sa_dir}/token")["content"]
    review = httpx.post(
        f"{k8s_cluster.credentials.server}/apis/authentication.k8s.io/v1/selfsubjectreviews",
        json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        headers={"Authorization": f"Bearer {token}"},
        verify=ssl.create_default_context(cafile=str(ca)),
        timeout=30,
    )
    assert review.status_code == 201, review.text
    user = review.json()["status"]["userInfo"]
    assert user["username"] == f"system:serviceaccount:{namespace}:default"
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == ["in-cluster"]
