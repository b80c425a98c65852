"""The Helm chart's lifecycle jobs, run from the operator image:

    python -m polykv_operator.hooks apply-crds DIR
        pre-upgrade: create or replace our CRDs with DIR/*.yaml
    python -m polykv_operator.hooks release [--timeout S] [--namespace NS ...]
        pre-delete: delete every PolyKV object, wait while the operator releases them
    python -m polykv_operator.hooks check --operator NS/SELECTOR [--engine NS/NAME ...]
        [--policy NS/NAME ...] [--pool NS/NAME/ENGINE ...]
        `helm test`: the release's objects are Ready and its engines serve
    python -m polykv_operator.hooks master-key --namespace NS --secret NAME --key KEY
        pre-install, pre-upgrade (Argo CD: PreSync): create the master key Secret once,
        when it is absent; never rewrite it
    python -m polykv_operator.hooks external-metrics-tls --namespace NS --secret NAME
        --service SVC
        pre-install, pre-upgrade (Argo CD: PreSync), with autoscaling.externalMetrics: fail
        when another provider holds the APIService; create the serving certificate's Secret
        once, when it is absent

Helm installs a chart's crds/ once and never upgrades them, so the pre-upgrade job replaces
each CRD with the chart's copy. On uninstall, the operator must still be running while its
objects go: their finalizer releases pools on the engines. The pre-delete job deletes pools
and policies first, then engines, and waits until the API server has none left; on timeout
it names what stays and fails, and so does `helm uninstall` (nothing is stranded silently).

The master key is a Secret the chart never renders: `helm template` and Argo CD do not
run Helm's `lookup`, so a rendered Secret would get a new key at every sync (and every
engine's admin key with it). The job creates it with a random key when it is missing and
leaves an existing one alone, so any number of syncs keep one key. The external metrics
API's serving certificate is made the same way (and its CA reaches the APIService through
the operator, at run time).

Credentials: in-cluster (the job's ServiceAccount), else the kubeconfig.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from .api import ADMISSION, ENGINE, GROUP, POOL, VERSION
from .names import http_url

# Deleted in this order: pools and policies need their engine to be released on it.
WAVES: tuple[tuple[str, ...], ...] = ((POOL.plural, ADMISSION.plural), (ENGINE.plural,))


def _clients() -> Any:
    from kubernetes import client
    from kubernetes import config as kube_config

    config: Any = kube_config  # untyped package
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client


def apply_crds(directory: Path) -> list[str]:
    """Creates or replaces every CRD in `directory`; returns what was done, one line each."""
    client = _clients()
    api = client.ApiextensionsV1Api()
    done = []
    for path in sorted(directory.glob("*.yaml")):
        body = yaml.safe_load(path.read_text())
        name = body["metadata"]["name"]
        try:
            current = api.read_custom_resource_definition(name)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            api.create_custom_resource_definition(body)
            done.append(f"created {name}")
            continue
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        # Keep what others put there (Helm's ownership annotations, say).
        for key in ("labels", "annotations"):
            merged = dict(getattr(current.metadata, key) or {})
            merged.update(body["metadata"].get(key) or {})
            body["metadata"][key] = merged
        api.replace_custom_resource_definition(name, body)
        done.append(f"replaced {name}")
    return done


def _remaining(api: Any, plural: str, namespaces: Sequence[str]) -> list[str]:
    if namespaces:
        items = [
            i
            for ns in namespaces
            for i in api.list_namespaced_custom_object(GROUP, VERSION, ns, plural)["items"]
        ]
    else:
        items = api.list_cluster_custom_object(GROUP, VERSION, plural)["items"]
    return [f"{plural}/{i['metadata']['namespace']}/{i['metadata']['name']}" for i in items]


def release(namespaces: Sequence[str], timeout_s: float, out: Any = sys.stdout) -> list[str]:
    """Deletes every PolyKV object (in `namespaces`, or everywhere) wave by wave and waits
    for each wave to be gone. Returns what is left when the time is up (empty: all gone)."""
    client = _clients()
    api = client.CustomObjectsApi()
    deadline = time.monotonic() + timeout_s
    for wave in WAVES:
        for plural in wave:
            for ref in _remaining(api, plural, namespaces):
                _, ns, name = ref.split("/")
                try:
                    api.delete_namespaced_custom_object(GROUP, VERSION, ns, plural, name)
                    print(f"deleting {ref}", file=out, flush=True)
                except client.ApiException as exc:
                    if exc.status != 404:
                        raise
        while True:
            left = [r for plural in wave for r in _remaining(api, plural, namespaces)]
            if not left:
                break
            if time.monotonic() > deadline:
                return left
            time.sleep(1.0)
    return []


class CheckFailed(RuntimeError):
    pass


def _ready(obj: dict[str, Any]) -> str | None:
    """None when Ready is True for the current generation, else why not."""
    st = obj.get("status") or {}
    if st.get("observedGeneration") != obj["metadata"].get("generation"):
        return "status not observed yet"
    for c in st.get("conditions") or []:
        if c.get("type") == "Ready":
            if c.get("status") == "True":
                return None
            return f"Ready={c.get('status')} {c.get('reason', '')}: {c.get('message', '')}"
    return "no Ready condition"


def _until(what: str, probe: Callable[[], str | None], deadline: float, out: Any) -> None:
    last = ""
    while True:
        why = probe()
        if why is None:
            print(f"ok: {what}", file=out, flush=True)
            return
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what}: {why}")
        if why != last:
            print(f"waiting: {what}: {why}", file=out, flush=True)
            last = why
        time.sleep(1.0)


def check(
    operator: str,
    metrics_port: int,
    engines: Sequence[str],
    policies: Sequence[str],
    pools: Sequence[str],
    timeout_s: float,
    out: Any = sys.stdout,
) -> None:
    """What `helm test` proves: the operator serves metrics; every engine, policy and pool of
    the release is Ready; every engine replica answers /health and holds its pools (its
    /metrics has a series for each)."""
    import httpx

    client = _clients()
    core, custom = client.CoreV1Api(), client.CustomObjectsApi()
    deadline = time.monotonic() + timeout_s
    ns, selector = operator.split("/", 1)

    def operator_metrics() -> str | None:
        pods = core.list_namespaced_pod(ns, label_selector=selector).items
        ips = [p.status.pod_ip for p in pods if p.status.pod_ip and p.status.phase == "Running"]
        if not ips:
            return "no running operator pod"
        try:
            text = httpx.get(f"{http_url(ips[0], metrics_port)}/metrics", timeout=5).text
        except httpx.HTTPError as exc:
            return f"metrics: {exc!r}"
        return None if "polykv_operator_reconcile_total" in text else "no operator series yet"

    _until("operator metrics", operator_metrics, deadline, out)

    def get(plural: str, ref: str) -> dict[str, Any]:
        ref_ns, name = ref.split("/")[:2]
        obj: dict[str, Any] = custom.get_namespaced_custom_object(
            GROUP, VERSION, ref_ns, plural, name
        )
        return obj

    for plural, refs in (
        (ENGINE.plural, engines),
        (ADMISSION.plural, policies),
        (POOL.plural, [p.rsplit("/", 1)[0] for p in pools]),
    ):
        for ref in refs:
            probe = functools.partial(lambda p, r: _ready(get(p, r)), plural, ref)
            _until(f"{plural}/{ref} Ready", probe, deadline, out)

    triples = [tuple(p.split("/")) for p in pools]  # (namespace, pool, engine)
    for ref in engines:
        ref_ns, engine_name = ref.split("/")
        declared = {t[1] for t in triples if t[0] == ref_ns and t[2] == engine_name}
        engine = get(ENGINE.plural, ref)
        replicas = (engine.get("status") or {}).get("replicaStatus") or []
        if not replicas:
            raise CheckFailed(f"{ref}: no replicas in status")
        port = int((engine.get("spec") or {}).get("port", 8080))
        for replica in replicas:
            base = http_url(replica["podIP"], port)
            health = httpx.get(f"{base}/health", timeout=10)
            if health.status_code != 200:
                raise CheckFailed(f"{ref} {replica['pod']}: /health {health.status_code}")
            # /metrics is open (the pool listing needs a key): one series per pool held.
            scrape = httpx.get(f"{base}/metrics", timeout=10).text
            names = set(re.findall(r'^polykv_pool_own_kv_bytes\{pool="([^"]+)"\}', scrape, re.M))
            if not declared <= names:
                raise CheckFailed(f"{ref} {replica['pod']}: lacks pools {sorted(declared - names)}")
            print(f"ok: {ref} {replica['pod']} healthy, holds {sorted(declared)}", file=out)


def _create_once(namespace: str, secret: str, body: Callable[[], dict[str, Any]]) -> str:
    """Creates Secret `secret` from `body()` unless it exists (then `body` is not called);
    says which. Another sync's job making it meanwhile is the same as finding it."""
    client = _clients()
    core = client.CoreV1Api()
    try:
        core.read_namespaced_secret(secret, namespace)
        return f"kept {namespace}/{secret}"
    except client.ApiException as exc:
        if exc.status != 404:
            raise
    try:
        core.create_namespaced_secret(namespace, {"apiVersion": "v1", "kind": "Secret", **body()})
    except client.ApiException as exc:
        if exc.status != 409:
            raise
        return f"kept {namespace}/{secret}"
    return f"created {namespace}/{secret}"


def ensure_master_key(namespace: str, secret: str, key: str) -> str:
    """Creates Secret `secret` with a random `key` unless it exists; says which."""
    import secrets as random_source

    return _create_once(
        namespace,
        secret,
        lambda: {
            "metadata": {
                "name": secret,
                "labels": {"app.kubernetes.io/part-of": "polykv"},
                # Never deleted with the release: a reinstall keeps every engine's admin key.
                "annotations": {"helm.sh/resource-policy": "keep"},
            },
            "type": "Opaque",
            "stringData": {key: random_source.token_urlsafe(48)},
        },
    )


def ensure_external_metrics_tls(namespace: str, secret: str, service: str) -> str:
    """Before the external metrics API is installed: refuses (ProviderTaken) when another
    provider holds the APIService, and creates the serving certificate's Secret (type
    kubernetes.io/tls, with the CA in ca.crt) unless it exists; says which."""
    import base64

    from .autoscale.apiservice import verdict
    from .autoscale.external_metrics import APISERVICE_NAME
    from .autoscale.serving_cert import service_names, serving_certificate

    client = _clients()
    try:
        found = client.ApiregistrationV1Api().read_api_service(APISERVICE_NAME)
    except client.ApiException as exc:
        if exc.status != 404:
            raise
    else:
        existing = client.ApiClient().sanitize_for_serialization(found)
        v = verdict(existing, namespace, service)
        if not v.serve:
            raise ProviderTaken(
                "autoscaling.externalMetrics: another external metrics provider (KEDA, "
                f"prometheus-adapter) serves this cluster. {v.message}; with the chart: "
                "autoscaling.kind=keda"
            )

    def body() -> dict[str, Any]:
        made = serving_certificate(service_names(service, namespace))
        data = {"ca.crt": made.ca_pem, "tls.crt": made.cert_pem, "tls.key": made.key_pem}
        return {
            "metadata": {"name": secret, "labels": {"app.kubernetes.io/part-of": "polykv"}},
            "type": "kubernetes.io/tls",
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }

    return _create_once(namespace, secret, body)


class ProviderTaken(RuntimeError):
    pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m polykv_operator.hooks", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("apply-crds", help="create or replace the CRDs in a directory")
    a.add_argument("directory", type=Path)
    r = sub.add_parser("release", help="delete every PolyKV object and wait until gone")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    r.add_argument(
        "--namespace", action="append", default=[], help="only this namespace (repeatable)"
    )
    c = sub.add_parser("check", help="helm test: the release's objects are Ready and serve")
    c.add_argument("--operator", required=True, help="NS/LABEL-SELECTOR of the operator pod")
    c.add_argument("--metrics-port", type=int, default=9090)
    c.add_argument("--engine", action="append", default=[], help="NS/NAME (repeatable)")
    c.add_argument("--policy", action="append", default=[], help="NS/NAME (repeatable)")
    c.add_argument("--pool", action="append", default=[], help="NS/NAME/ENGINE (repeatable)")
    c.add_argument("--timeout", type=float, default=240.0)
    m = sub.add_parser("master-key", help="create the master key Secret when it is absent")
    m.add_argument("--namespace", required=True)
    m.add_argument("--secret", required=True)
    m.add_argument("--key", required=True, help="the data key holding the master key")
    t = sub.add_parser(
        "external-metrics-tls",
        help="refuse next to another metrics provider; create the serving Secret if absent",
    )
    t.add_argument("--namespace", required=True)
    t.add_argument("--secret", required=True)
    t.add_argument("--service", required=True, help="the Service the APIService routes to")
    args = p.parse_args(argv)
    if args.command == "external-metrics-tls":
        try:
            print(ensure_external_metrics_tls(args.namespace, args.secret, args.service))
        except ProviderTaken as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "master-key":
        print(ensure_master_key(args.namespace, args.secret, args.key), flush=True)
        return 0
    if args.command == "check":
        try:
            check(
                args.operator,
                args.metrics_port,
                args.engine,
                args.policy,
                args.pool,
                args.timeout,
            )
        except CheckFailed as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        print("every check passed", flush=True)
        return 0
    if args.command == "apply-crds":
        for line in apply_crds(args.directory):
            print(line, flush=True)
        return 0
    left = release(args.namespace, args.timeout)
    if left:
        print(
            f"still present after {args.timeout:.0f}s (their finalizer waits on the operator): "
            + ", ".join(left),
            file=sys.stderr,
        )
        return 1
    print("every PolyKV object is gone", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
