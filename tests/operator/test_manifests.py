"""Engine manifests: readiness gate, probes, restricted security, flags from the spec."""

from __future__ import annotations

from polykv_operator import manifests
from polykv_operator.names import GATE

from .builders import engine_spec


def test_deployment_flags_gate_and_probes() -> None:
    spec = engine_spec(parallel=8, contextSize=32768, maxPools=16, threads=2, replicas=3)
    d = manifests.deployment("qwen", spec)
    assert d["spec"]["replicas"] == 3
    assert d["spec"]["selector"] == {"matchLabels": {"polykv.io/engine": "qwen"}}
    pod = d["spec"]["template"]["spec"]
    assert pod["readinessGates"] == [{"conditionType": GATE}]
    c = pod["containers"][0]
    args = c["args"]
    assert args[:8] == [
        "-m",
        "/models/m.gguf",
        "-c",
        "32768",
        "-np",
        "8",
        "--polykv-max-pools",
        "16",
    ]
    assert args[args.index("-t") + 1] == "2"
    assert not any("key" in a for a in args)  # secrets travel in env, not argv
    assert c["env"][0]["name"] == "POLYKV_ADMIN_KEY"
    assert c["env"][0]["valueFrom"]["secretKeyRef"] == {
        "name": "qwen-polykv-admin",
        "key": "admin-key",
    }
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    assert d["spec"]["template"]["metadata"]["labels"]["polykv.io/engine"] == "qwen"


def test_restricted_pod_security() -> None:
    pod = manifests.deployment(
        "e",
        engine_spec(
            model={
                "path": "/models/m.gguf",
                "init": {"command": ["fetch", "/models/m.gguf"]},
            }
        ),
    )["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in pod["containers"] + pod["initContainers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False


def test_model_volume_and_init() -> None:
    spec = engine_spec(
        model={
            "path": "/weights/q.gguf",
            "volume": {"persistentVolumeClaim": {"claimName": "models"}},
            "init": {"command": ["download", "/weights/q.gguf"]},
        }
    )
    pod = manifests.deployment("e", spec)["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "model", "persistentVolumeClaim": {"claimName": "models"}}]
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "model", "mountPath": "/weights", "readOnly": True}
    ]
    init = pod["initContainers"][0]
    assert init["image"] == spec.image and init["command"] == ["download", "/weights/q.gguf"]
    assert init["volumeMounts"][0]["readOnly"] is False
    default = manifests.deployment("e", engine_spec())["spec"]["template"]["spec"]
    assert default["volumes"] == [{"name": "model", "emptyDir": {}}]


def test_api_key_from_a_secret() -> None:
    spec = engine_spec(apiKeySecretRef={"name": "keys", "key": "inference"})
    c = manifests.deployment("e", spec)["spec"]["template"]["spec"]["containers"][0]
    assert "--api-key" not in c["args"]
    assert c["env"][1]["name"] == "LLAMA_API_KEY"
    assert c["env"][1]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "inference"}


def test_service_and_secret() -> None:
    svc = manifests.service("e", engine_spec(port=9000))
    assert svc["spec"]["selector"] == {"polykv.io/engine": "e"}
    assert svc["spec"]["ports"][0]["port"] == 9000
    sec = manifests.admin_secret("e", "k")
    assert sec["stringData"] == {"admin-key": "k"} and sec["metadata"]["name"] == "e-polykv-admin"


def test_admin_key_is_derived_per_engine_incarnation() -> None:
    k = manifests.admin_key("master", "ns", "e", "uid1")
    assert k == manifests.admin_key("master", "ns", "e", "uid1") and len(k) == 64
    assert k != manifests.admin_key("master", "ns", "e", "uid2")
    assert k != manifests.admin_key("other", "ns", "e", "uid1")
