"""A container's environment and the `$(VAR)` expansion of its command line, as a
kubelet computes them, with ConfigMap/Secret values read from the API."""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from typing import Any

from ..kubeapi import ApiError, Kube, Obj

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ConfigError(ValueError):
    """Reported like a kubelet does: CreateContainerConfigError."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """`$(VAR)` becomes VAR's value when defined and stays literal otherwise; `$$` is `$`."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def field_ref(path: str, pod: Obj, pod_ip: str = "", host_ip: str = "") -> str:
    meta: dict[str, Any] = pod["metadata"]
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return str(simple[path])
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    raise ConfigError(f"unsupported fieldRef {path!r}")


class SourceReader:
    """Reads ConfigMap and Secret data for env and volumes, one GET per object."""

    def __init__(self, api: Kube, namespace: str) -> None:
        self.api = api
        self.namespace = namespace

    def data(self, kind: str, name: str, optional: bool = False) -> dict[str, str] | None:
        plural = "configmaps" if kind == "configMap" else "secrets"
        try:
            obj = self.api.get(f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")
        except ApiError as exc:
            if exc.status == 404 and optional:
                return None
            raise ConfigError(f"{kind} {name!r}: {exc.message}") from None
        raw: dict[str, str] = obj.get("data") or {}
        if kind == "secret":
            return {k: base64.b64decode(v).decode() for k, v in raw.items()}
        return dict(raw)


def container_env(
    container: Obj,
    pod: Obj,
    base: Mapping[str, str],
    reader: SourceReader,
    pod_ip: str,
    host_ip: str,
) -> dict[str, str]:
    env = dict(base)
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for kind in ("configMap", "secret"):
            ref = src.get(f"{kind}Ref")
            if ref:
                data = reader.data(kind, ref["name"], ref.get("optional", False)) or {}
                env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var:
            # Later entries may refer to earlier ones.
            env[name] = expand(var["value"], env)
            continue
        source = var.get("valueFrom") or {}
        if "fieldRef" in source:
            env[name] = field_ref(source["fieldRef"]["fieldPath"], pod, pod_ip, host_ip)
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind = "configMap" if "configMapKeyRef" in source else "secret"
            ref = source[f"{kind}KeyRef"]
            values = reader.data(kind, ref["name"], ref.get("optional", False))
            if values is not None and ref["key"] in values:
                env[name] = values[ref["key"]]
            elif not ref.get("optional", False):
                raise ConfigError(f"{kind} {ref['name']!r} has no key {ref['key']!r}")
        elif "resourceFieldRef" in source:
            env[name] = "0"  # no resource accounting for local processes
        else:
            env[name] = ""
    return env
