"""The NetworkPolicies the operator writes beside each engine and router: what they select,
who reaches them on which port, where they reach; the JSON the chart passes."""

from __future__ import annotations

import json

import pytest

from polykv_operator import manifests
from polykv_operator.config import Config, ConfigError
from polykv_operator.network_policies import NETWORK_POLICY_ENV, NetworkPolicyConfig

from .builders import engine_spec

AGENTS = {"podSelector": {"matchLabels": {"polykv.io/agent": "true"}}}
DNS = {"ports": [{"port": 53, "protocol": "UDP"}]}
MIRROR = {"to": [{"ipBlock": {"cidr": "203.0.113.10/32"}}], "ports": [{"port": 443}]}
API = {"to": [{"ipBlock": {"cidr": "10.96.0.1/32"}}], "ports": [{"port": 443}]}
CONFIG = NetworkPolicyConfig.parse(
    json.dumps(
        {
            "ingress": [AGENTS],
            "egress": [DNS],
            "modelEgress": [MIRROR],
            "routerIngress": [AGENTS],
            "routerEgress": [API, DNS],
        }
    )
)
INIT = {"path": "/models/m.gguf", "init": {"command": ["polykv-fetch-model", "m"]}}


def test_an_engine_is_reached_on_its_port_by_the_peers_and_its_router() -> None:
    spec = engine_spec(port=9000)
    (policy,) = [
        o
        for o in manifests.engine_objects("qwen", spec, [], CONFIG)
        if o["kind"] == "NetworkPolicy"
    ]
    assert policy["metadata"]["name"] == "qwen"
    assert policy["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "polykv-operator"
    body = policy["spec"]
    assert body["podSelector"] == {"matchLabels": {"polykv.io/engine": "qwen"}}
    assert body["policyTypes"] == ["Ingress", "Egress"]
    (rule,) = body["ingress"]
    assert rule["ports"] == [{"port": 9000, "protocol": "TCP"}]
    assert rule["from"] == [AGENTS, {"podSelector": {"matchLabels": {"polykv.io/router": "qwen"}}}]
    assert body["egress"] == [DNS]  # no model download: closed


def test_the_model_download_opens_only_for_an_engine_with_an_init_container() -> None:
    spec = engine_spec(model=INIT)
    policy = manifests.engine_objects("e", spec, [], CONFIG)[0]
    assert policy["spec"]["egress"] == [DNS, MIRROR]


def test_the_policy_comes_before_the_pods_and_only_when_configured() -> None:
    secret = manifests.api_key_secret("e", "k")
    kinds = [o["kind"] for o in manifests.engine_objects("e", engine_spec(), [secret], CONFIG)]
    assert kinds == ["Secret", "NetworkPolicy", "Deployment", "Service"]
    bare = [o["kind"] for o in manifests.engine_objects("e", engine_spec(), [secret], None)]
    assert bare == ["Secret", "Deployment", "Service"]


def test_a_router_reaches_its_engine_and_what_it_is_allowed() -> None:
    spec = engine_spec(port=9000, router={"enabled": True, "port": 8081})
    objs = manifests.router_objects("qwen", "agents", spec, "cr", CONFIG)
    assert [o["kind"] for o in objs] == [
        "ServiceAccount", "RoleBinding", "NetworkPolicy", "Deployment", "Service",
    ]  # fmt: skip
    body = objs[2]["spec"]
    assert objs[2]["metadata"]["name"] == "qwen-router"
    assert body["podSelector"] == {"matchLabels": {"polykv.io/router": "qwen"}}
    assert body["ingress"] == [{"from": [AGENTS], "ports": [{"port": 8081, "protocol": "TCP"}]}]
    to_engine, *rest = body["egress"]
    assert to_engine == {
        "to": [{"podSelector": {"matchLabels": {"polykv.io/engine": "qwen"}}}],
        "ports": [{"port": 9000, "protocol": "TCP"}],
    }
    assert rest == [API, DNS]
    assert ("networking.k8s.io/v1", "NetworkPolicy", "qwen-router") in (
        manifests.router_kinds("qwen")
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{", "is not JSON"),
        ("[]", "must be a JSON object"),
        ('{"ingres": []}', "unknown keys ['ingres']"),
        ('{"egress": {"ports": []}}', "egress must be a list of objects"),
    ],
)
def test_a_wrong_config_fails_the_start_naming_it(raw: str, message: str) -> None:
    with pytest.raises(ConfigError, match=NETWORK_POLICY_ENV) as err:
        Config.from_env({NETWORK_POLICY_ENV: raw})
    assert message in str(err.value)
    assert Config.from_env({}).network_policy is None
