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
    assert pod["volumes"][0] == {"name": "model", "persistentVolumeClaim": {"claimName": "models"}}
    assert pod["containers"][0]["volumeMounts"][0] == {
        "name": "model",
        "mountPath": "/weights",
        "readOnly": True,
    }
    init = pod["initContainers"][0]
    assert init["image"] == spec.image and init["command"] == ["download", "/weights/q.gguf"]
    assert init["volumeMounts"] == [{"name": "model", "mountPath": "/weights", "readOnly": False}]
    default = manifests.deployment("e", engine_spec())["spec"]["template"]["spec"]
    assert default["volumes"][0] == {"name": "model", "emptyDir": {}}


def _snapshot_parts(spec_fields: dict[str, object]) -> tuple[list[str], object, object]:
    pod = manifests.deployment("e", engine_spec(**spec_fields))["spec"]["template"]["spec"]
    c = pod["containers"][0]
    volume = next((v for v in pod["volumes"] if v["name"] == "snapshots"), None)
    mount = next((m for m in c["volumeMounts"] if m["name"] == "snapshots"), None)
    return c["args"], volume, mount


def test_snapshots_default_to_an_emptydir_with_room_for_a_file_on_its_way_in() -> None:
    args, volume, mount = _snapshot_parts({})
    assert args[args.index("--polykv-snapshot-dir") + 1] == manifests.SNAPSHOT_DIR
    assert args[args.index("--polykv-snapshot-mib") + 1] == "4096"
    assert args[args.index("--polykv-session-save-mib") + 1] == "1024"
    assert volume == {"name": "snapshots", "emptyDir": {"sizeLimit": "8192Mi"}}
    assert mount == {"name": "snapshots", "mountPath": manifests.SNAPSHOT_DIR}  # writable


def test_snapshots_on_a_claim_or_off() -> None:
    claim = {"persistentVolumeClaim": {"claimName": "polykv-snapshots"}}
    spec = {"volume": claim, "sizeMib": 100, "sessionsMib": 0}
    args, volume, _ = _snapshot_parts({"snapshots": spec})
    assert volume == {"name": "snapshots", **claim}
    assert args[args.index("--polykv-snapshot-mib") + 1] == "100"
    assert args[args.index("--polykv-session-save-mib") + 1] == "0"
    args, volume, mount = _snapshot_parts({"snapshots": {"enabled": False}})
    assert "--polykv-snapshot-dir" not in args and volume is None and mount is None


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
    sec = manifests.admin_secret("e", "k", "r")
    assert sec["stringData"] == {"admin-key": "k", "router-key": "r"}
    assert sec["metadata"]["name"] == "e-polykv-admin" and sec["type"] == "Opaque"
    gen = manifests.api_key_secret("e", "a")
    assert gen["stringData"] == {"api-key": "a"} and gen["metadata"]["name"] == "e-polykv-api-key"


def test_an_engine_without_api_key_ref_gets_the_generated_key_and_the_router_key() -> None:
    c = manifests.deployment("e", engine_spec())["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert env == {
        "POLYKV_ADMIN_KEY": {"name": "e-polykv-admin", "key": "admin-key"},
        "LLAMA_API_KEY": {"name": "e-polykv-api-key", "key": "api-key"},
        "POLYKV_ROUTER_KEY": {"name": "e-polykv-admin", "key": "router-key"},
    }
    keys = {
        manifests.admin_key("m", "ns", "e", "u"),
        *(manifests.derived_key("m", p, "ns", "e", "u") for p in ("api", "router")),
    }
    assert len(keys) == 3  # three different keys from one master


def test_admin_key_is_derived_per_engine_incarnation() -> None:
    k = manifests.admin_key("master", "ns", "e", "uid1")
    assert k == manifests.admin_key("master", "ns", "e", "uid1") and len(k) == 64
    assert k != manifests.admin_key("master", "ns", "e", "uid2")
    assert k != manifests.admin_key("other", "ns", "e", "uid1")


def test_router_objects_and_least_privilege() -> None:
    spec = engine_spec(
        port=9000,
        apiKeySecretRef={"name": "keys", "key": "api"},
        router={"enabled": True, "replicas": 2, "pollIntervalMs": 250},
    )
    sa, binding, deployment, service = manifests.router_objects("qwen", "agents", spec, "cr")
    assert [o["kind"] for o in (sa, binding, deployment, service)] == [
        "ServiceAccount", "RoleBinding", "Deployment", "Service",
    ]  # fmt: skip
    assert {o["metadata"]["name"] for o in (sa, deployment, service)} == {"qwen-router"}
    # Not the router's own name: an older layout's binding there has an immutable roleRef.
    assert binding["metadata"]["name"] == "qwen-router-pod-reader"
    assert manifests.legacy_router_binding("qwen")[2] == "qwen-router"
    assert [k[1:] for k in manifests.router_kinds("qwen")] == [
        ("Deployment", "qwen-router"), ("NetworkPolicy", "qwen-router"), ("Service", "qwen-router"),
        ("RoleBinding", "qwen-router-pod-reader"), ("ServiceAccount", "qwen-router"),
    ]  # fmt: skip
    # It may see the namespace's pods (the shared ClusterRole, bound here only): no Role of
    # its own, so the operator needs no verb on roles.
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "cr",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "qwen-router", "namespace": "agents"}
    ]
    assert sa["automountServiceAccountToken"] is False
    pod = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert "polykv.io/engine" not in labels  # never taken for an engine replica
    assert deployment["spec"]["selector"]["matchLabels"] == {"polykv.io/router": "qwen"}
    assert service["spec"]["selector"] == {"polykv.io/router": "qwen"}
    assert deployment["spec"]["replicas"] == 2
    assert pod["serviceAccountName"] == "qwen-router"
    assert pod["automountServiceAccountToken"] is False
    sources = pod["volumes"][0]["projected"]["sources"]
    assert sources[0]["serviceAccountToken"]["path"] == "token"
    c = pod["containers"][0]
    assert c["volumeMounts"][0]["mountPath"] == manifests.SA_DIR
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    env = {e["name"]: e for e in c["env"]}
    assert env["POLYKV_ROUTER_ENGINE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "keys",
        "key": "api",
    }
    assert not any("key" in a.lower() for a in c["args"])  # secrets travel in env


def test_the_router_command_line_is_one_the_router_accepts() -> None:
    """The operator writes polykv-router's flags; the router's own parser reads them."""
    from polykv_router.config import parse

    spec = engine_spec(port=9000, router={"enabled": True, "sessionTtlSeconds": 600})
    c = manifests.router_deployment("qwen", spec)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    cfg = parse(c["args"], {**env, "POLYKV_ROUTER_ENGINE_API_KEY": "k"})
    assert cfg.selector == "polykv.io/engine=qwen"
    assert (cfg.engine_port, cfg.session_ttl_s, cfg.poll_interval_s) == (9000, 600, 0.5)
    assert str(cfg.serviceaccount_dir) == manifests.SA_DIR
    assert cfg.engine_api_key == "k"
    assert cfg.port == c["ports"][0]["containerPort"]


def test_the_router_never_holds_the_admin_key() -> None:
    """The router reads with the engine's generated API key and marks what it forwards with
    the router key; it is never given the key that manages pools."""
    spec = engine_spec(router={"enabled": True})
    c = manifests.router_deployment("qwen", spec)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in c["env"]}
    assert env["POLYKV_ROUTER_ENGINE_API_KEY"] == {"name": "qwen-polykv-api-key", "key": "api-key"}
    assert env["POLYKV_ROUTER_KEY"] == {"name": "qwen-polykv-admin", "key": "router-key"}
    assert "admin-key" not in str(c)


def test_router_defaults_are_off() -> None:
    assert engine_spec().router is None
    spec = engine_spec(router={})
    assert spec.router is not None and not spec.router.enabled and spec.router.replicas == 1
