"""The autoscaling endpoints: the external.metrics.k8s.io documents, the KEDA JSON, the
APIService verdict, and both servers over real sockets (TLS with client certificates)."""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from polykv_operator.autoscale import apiservice, report
from polykv_operator.autoscale import external_metrics as em
from polykv_operator.autoscale.aggregate import PoolPart, ReplicaPart, Signal, combine
from polykv_operator.autoscale.metrics_api import ExternalSettings, Servers
from polykv_operator.autoscale.tls import AUTH_CONFIGMAP, FrontProxy, TlsError, common_name
from polykv_testenv import pki
from polykv_testenv.waiting import free_port

NOW = 1_700_000_000.0
FRESH = combine(
    [ReplicaPart("eng-1", NOW - 2, (PoolPart("crew", 5.0, 2, 12.5),), 2, 1, 2)], NOW
)  # pressure 0.8, demand 0.75
STALE = combine([ReplicaPart("eng-1", NOW - 40, (), 0, 0, 4)], NOW)
SELECTOR = "polykv.io/engine=eng"


# --------------------------------------------------------------------- the documents


def test_one_item_per_selector_with_the_value_as_a_quantity() -> None:
    req = em.MetricRequest("agents", "polykv_floor_pressure", "eng")
    doc = em.value_list(req, FRESH)
    assert doc["kind"] == "ExternalMetricValueList"
    (item,) = doc["items"]
    assert item["value"] == "800m" and item["metricLabels"] == {"polykv.io/engine": "eng"}
    assert item["timestamp"] == em.rfc3339(NOW - 2)
    demand = em.value_list(em.MetricRequest("agents", "polykv_session_demand_ratio", "eng"), FRESH)
    assert demand["items"][0]["value"] == "750m"


@pytest.mark.parametrize(
    ("value", "text"), [(0.0, "0"), (0.8, "800m"), (2.0, "2"), (1.2346, "1235m"), (4e4, "40000")]
)
def test_quantities(value: float, text: str) -> None:
    assert em.quantity(value) == text


def test_stale_unknown_engine_and_unknown_metric_are_errors_not_values() -> None:
    with pytest.raises(em.ApiError) as stale:
        em.value_list(em.MetricRequest("agents", "polykv_floor_pressure", "eng"), STALE)
    assert stale.value.code == 503 and "stale" in stale.value.message
    with pytest.raises(em.ApiError) as unknown:
        em.value_list(em.MetricRequest("agents", "polykv_floor_pressure", "nope"), None)
    assert unknown.value.code == 404
    with pytest.raises(em.ApiError) as metric:
        em.value_list(em.MetricRequest("agents", "cpu", "eng"), FRESH)
    assert metric.value.code == 404 and "polykv_floor_pressure" in metric.value.message


@pytest.mark.parametrize(
    "selector", ["polykv.io/engine=eng", "polykv.io/engine==eng", "polykv.io/engine in (eng)"]
)
def test_a_selector_naming_one_engine(selector: str) -> None:
    assert em.engine_of(selector) == "eng"


@pytest.mark.parametrize(
    "selector",
    [
        None,
        "",
        "polykv.io/engine",
        "polykv.io/engine!=eng",
        "polykv.io/engine in (a,b)",
        "polykv.io/engine notin (eng)",
        "polykv.io/engine=a,polykv.io/engine=b",
        "polykv.io/engine=eng,tier=gold",
        "app=eng",
        "polykv.io/engine=",
        "polykv.io/engine in eng",
    ],
)
def test_a_selector_that_names_no_single_engine_is_refused(selector: str | None) -> None:
    with pytest.raises(em.ApiError) as err:
        em.engine_of(selector)
    assert err.value.code == 400 and err.value.reason == "BadRequest"


@pytest.mark.parametrize(
    "path",
    [
        "/apis/external.metrics.k8s.io/v1beta1/namespaces/agents",
        "/apis/external.metrics.k8s.io/v1beta1/foo/agents/polykv_floor_pressure",
        "/apis/external.metrics.k8s.io/v1beta1/namespaces//polykv_floor_pressure",
        "/apis/external.metrics.k8s.io/v1beta1/namespaces/a/b/c",
    ],
)
def test_malformed_metric_paths_are_not_found(path: str) -> None:
    with pytest.raises(em.ApiError) as err:
        em.parse_path(path)
    assert err.value.code == 404


def test_discovery_lists_both_metrics() -> None:
    doc = em.resource_list()
    assert doc["groupVersion"] == "external.metrics.k8s.io/v1beta1"
    assert {r["name"] for r in doc["resources"]} == set(em.METRICS)
    assert all(r["namespaced"] and r["verbs"] == ["get"] for r in doc["resources"])


def test_the_keda_document_fresh_and_stale() -> None:
    status, body = report.document("agents", "eng", FRESH, NOW)
    assert status == 200 and body["floor_pressure"] == 0.8 and body["stale"] is False
    assert body["session_demand_ratio"] == 0.75 and body["age_seconds"] == 2.0
    assert body["pools"]["crew"] == {
        "floor": 5.0,
        "active_sessions": 2,
        "active_tps_sum": 12.5,
        "floor_pressure": 0.8,
    }
    assert body["sessions"] == {"active": 2, "refused": 1, "headroom": 2}
    status, body = report.document("agents", "eng", STALE, NOW)
    assert status == 503 and body["stale"] is True and body["floor_pressure"] is None
    assert "40 s old" in body["reason"]


@pytest.mark.parametrize(
    "path", ["/polykv/autoscale/agents", "/polykv/autoscale/a/b/c", "/polykv/autoscale//eng"]
)
def test_malformed_keda_paths(path: str) -> None:
    assert report.parse_path(path) is None


# --------------------------------------------------------------------- the APIService


def test_apiservice_verdicts() -> None:
    ours = apiservice.desired("polykv-system", "polykv-metrics", 443, b"PEM")
    assert ours["metadata"]["name"] == "v1beta1.external.metrics.k8s.io"
    assert base64.b64decode(ours["spec"]["caBundle"]) == b"PEM"
    assert apiservice.verdict(ours, "polykv-system", "polykv-metrics").state == "ours"
    assert apiservice.verdict(None, "polykv-system", "polykv-metrics").serve
    keda = {
        "metadata": {"name": "v1beta1.external.metrics.k8s.io"},
        "spec": {"service": {"namespace": "keda", "name": "keda-operator-metrics-apiserver"}},
    }
    v = apiservice.verdict(keda, "polykv-system", "polykv-metrics")
    assert v.state == "foreign" and not v.serve and "keda/keda-operator-metrics" in v.message
    # Our label on an APIService routed elsewhere is not ours either.
    moved = {**ours, "spec": {**ours["spec"], "service": {"namespace": "x", "name": "y"}}}
    assert apiservice.verdict(moved, "polykv-system", "polykv-metrics").state == "foreign"


# --------------------------------------------------------------------- TLS


def test_front_proxy_settings_from_the_configmap() -> None:
    ca = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    fp = FrontProxy.from_configmap(
        {"requestheader-client-ca-file": ca, "requestheader-allowed-names": '["front-proxy"]'}
    )
    assert fp.allowed_names == {"front-proxy"}
    peer = {"subject": ((("commonName", "front-proxy"),),)}
    assert common_name(peer) == "front-proxy" and fp.admits(peer)
    assert not fp.admits({"subject": ((("commonName", "someone"),),)})
    assert not fp.admits(None) and not fp.admits({})
    anyone = FrontProxy.from_configmap({"requestheader-client-ca-file": ca})
    assert anyone.admits({"subject": ((("commonName", "someone"),),)})
    with pytest.raises(TlsError, match="aggregation layer"):
        FrontProxy.from_configmap({})
    with pytest.raises(TlsError, match="JSON list"):
        FrontProxy.from_configmap(
            {"requestheader-client-ca-file": ca, "requestheader-allowed-names": "front"}
        )


# --------------------------------------------------------------------- the servers


@dataclass
class Certs:
    serving_ca: Path
    cert: Path
    key: Path
    front_proxy_ca: Path
    aggregator: tuple[Path, Path]  # signed by the front-proxy CA, allowed name
    other_name: tuple[Path, Path]  # signed by the front-proxy CA, another name
    stranger: tuple[Path, Path]  # signed by an unrelated CA


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("certs")
    serving = pki.authority(d, "serving")
    cert, key = pki.leaf(serving, d, "server", "polykv-metrics", ("localhost",))
    fp = pki.authority(d, "front-proxy")
    other = pki.authority(d, "other")
    return Certs(
        serving.cert,
        cert,
        key,
        fp.cert,
        pki.leaf(fp, d, "aggregator", "front-proxy-client"),
        pki.leaf(fp, d, "someone", "someone-else"),
        pki.leaf(other, d, "stranger", "front-proxy-client"),
    )


def source(signals: dict[tuple[str, str], Signal]) -> Callable[[str, str], Signal | None]:
    return lambda ns, engine: signals.get((ns, engine))


@pytest.fixture
async def servers(certs: Certs) -> AsyncIterator[tuple[Servers, int, int]]:
    configmap = {
        "data": {
            "requestheader-client-ca-file": certs.front_proxy_ca.read_text(),
            "requestheader-allowed-names": '["front-proxy-client"]',
        }
    }

    async def get(path: str) -> dict[str, Any] | None:
        return configmap if path == AUTH_CONFIGMAP else None

    s = Servers()
    json_port, tls_port = free_port(), free_port()
    src = source({("agents", "eng"): FRESH, ("agents", "old"): STALE})
    await s.start_json(src, "127.0.0.1", json_port)
    settings = ExternalSettings(
        "127.0.0.1", tls_port, certs.cert, certs.key, "polykv-system", "polykv-metrics"
    )
    await s.start_external(src, settings, get)
    assert s.external == "serving"
    try:
        yield s, json_port, tls_port
    finally:
        await s.stop()


def tls_client(certs: Certs, client: tuple[Path, Path] | None) -> httpx.AsyncClient:
    ctx = ssl.create_default_context(cafile=str(certs.serving_ca))
    if client is not None:
        ctx.load_cert_chain(str(client[0]), str(client[1]))
    return httpx.AsyncClient(verify=ctx, timeout=10)


async def test_json_server(servers: tuple[Servers, int, int]) -> None:
    _, port, _ = servers
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        ok = await c.get("/polykv/autoscale/agents/eng")
        assert ok.status_code == 200 and ok.json()["floor_pressure"] == 0.8
        stale = await c.get("/polykv/autoscale/agents/old")
        assert stale.status_code == 503 and stale.json()["stale"] is True
        assert (await c.get("/polykv/autoscale/agents/nope")).status_code == 404
        assert (await c.get("/polykv/autoscale/agents")).status_code == 404
        assert (await c.get("/healthz")).text == "ok"


async def test_the_external_api_answers_the_aggregator(
    servers: tuple[Servers, int, int], certs: Certs
) -> None:
    _, _, port = servers
    base = f"https://localhost:{port}{em.ROOT}"
    async with tls_client(certs, certs.aggregator) as c:
        disc = await c.get(base)
        assert disc.status_code == 200 and disc.json()["kind"] == "APIResourceList"
        r = await c.get(
            f"{base}/namespaces/agents/polykv_floor_pressure", params={"labelSelector": SELECTOR}
        )
        assert r.status_code == 200, r.text
        assert [i["value"] for i in r.json()["items"]] == ["800m"]
        fp = "/namespaces/agents/polykv_floor_pressure"
        for path, params, code in [
            (fp, {}, 400),
            (fp, {"labelSelector": "app=x"}, 400),
            (fp, {"labelSelector": "polykv.io/engine=old"}, 503),
            (fp, {"labelSelector": "polykv.io/engine=no"}, 404),
            ("/namespaces/agents/cpu_usage", {"labelSelector": SELECTOR}, 404),
            ("/namespaces/agents", {}, 404),
        ]:
            bad = await c.get(base + path, params=params)
            assert bad.status_code == code, (path, params, bad.text)
            assert bad.json()["kind"] == "Status" and bad.json()["code"] == code
        assert (await c.get(f"https://localhost:{port}/openapi/v2")).json()["swagger"] == "2.0"
        assert (await c.post(base)).status_code == 404


@pytest.mark.parametrize("who", [None, "other_name"])
async def test_the_external_api_refuses_anyone_else(
    servers: tuple[Servers, int, int], certs: Certs, who: str | None
) -> None:
    _, _, port = servers
    client = getattr(certs, who) if who else None
    async with tls_client(certs, client) as c:
        r = await c.get(f"https://localhost:{port}{em.ROOT}")
        assert r.status_code == 401 and r.json()["reason"] == "Unauthorized"
        assert (await c.get(f"https://localhost:{port}/healthz")).text == "ok"


async def test_a_client_certificate_from_another_ca_fails_the_handshake(
    servers: tuple[Servers, int, int], certs: Certs
) -> None:
    _, _, port = servers
    async with tls_client(certs, certs.stranger) as c:
        with pytest.raises(httpx.HTTPError):
            r = await c.get(f"https://localhost:{port}{em.ROOT}")
            assert r.status_code != 200  # TLS 1.3 may report the alert on the first read


async def test_no_external_api_next_to_another_provider(certs: Certs) -> None:
    keda = {"spec": {"service": {"namespace": "keda", "name": "keda-metrics"}}}

    async def get(path: str) -> dict[str, Any] | None:
        return keda if path.startswith("/apis/apiregistration") else None

    s = Servers()
    port = free_port()
    settings = ExternalSettings(
        "127.0.0.1", port, certs.cert, certs.key, "polykv-system", "polykv-metrics"
    )
    await s.start_external(source({}), settings, get)
    try:
        assert s.external == "refused" and s.runners == []
    finally:
        await s.stop()


async def test_without_the_aggregation_layer_the_api_is_not_served(certs: Certs) -> None:
    async def get(path: str) -> dict[str, Any] | None:
        return {"data": {}} if path == AUTH_CONFIGMAP else None

    s = Servers()
    settings = ExternalSettings(
        "127.0.0.1", free_port(), certs.cert, certs.key, "polykv-system", "polykv-metrics"
    )
    await s.start_external(source({}), settings, get)
    assert s.external == "failed" and s.runners == []


def test_documents_are_json() -> None:
    for doc in (em.resource_list(), em.openapi_v2(), em.openapi_v3()):
        json.dumps(doc)
