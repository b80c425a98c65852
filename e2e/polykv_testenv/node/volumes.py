"""Pod volumes as local directories, and the rewriting of mount paths in a container's
command line, environment and working directory to those directories.

A process cannot see a mount namespace, so `/models/m.gguf` under a volume mounted at
`/models` is rewritten to `<volume dir>/m.gguf` wherever it appears as a path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..kubeapi import ApiError, Obj
from .podenv import ConfigError, SourceReader, field_ref
from .serviceaccount import bound_token


def prepare(pod: Obj, pod_dir: Path, claims_dir: Path, reader: SourceReader) -> dict[str, Path]:
    """Creates or locates every volume of the pod; returns volume name -> local path."""
    out: dict[str, Path] = {}
    for vol in pod["spec"].get("volumes") or []:
        name = vol["name"]
        own = pod_dir / "volumes" / name
        if "emptyDir" in vol:
            own.mkdir(parents=True, exist_ok=True)
            out[name] = own
        elif "hostPath" in vol:
            path = Path(vol["hostPath"]["path"])
            if vol["hostPath"].get("type") == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            out[name] = path
        elif "persistentVolumeClaim" in vol:
            # A claim is a directory that outlives its pods (a trivial local provisioner).
            claim = vol["persistentVolumeClaim"]["claimName"]
            path = claims_dir / pod["metadata"]["namespace"] / claim
            path.mkdir(parents=True, exist_ok=True)
            out[name] = path
        elif "configMap" in vol or "secret" in vol:
            kind = "configMap" if "configMap" in vol else "secret"
            src: dict[str, Any] = vol[kind]
            obj_name = src.get("name") or src.get("secretName", "")
            data = reader.data(kind, obj_name, src.get("optional", False)) or {}
            _write_files(own, data, src.get("items"))
            out[name] = own
        elif "projected" in vol:
            for source in vol["projected"].get("sources") or []:
                for kind in ("configMap", "secret"):
                    if kind in source:
                        ref = source[kind]
                        data = reader.data(kind, ref["name"], ref.get("optional", False)) or {}
                        _write_files(own, data, ref.get("items"))
                if "serviceAccountToken" in source:
                    sat = source["serviceAccountToken"]
                    try:
                        token = bound_token(
                            reader.api, pod, int(sat.get("expirationSeconds", 3600)),
                            sat.get("audience"),
                        )  # fmt: skip
                    except ApiError as exc:  # retried like a kubelet: the container waits
                        raise ConfigError(f"volume {name!r}: token: {exc.message}") from None
                    _write_files(own, {"token": token}, [{"key": "token", "path": sat["path"]}])
                if "downwardAPI" in source:
                    _write_files(own, _downward(pod, source["downwardAPI"]), None)
            own.mkdir(parents=True, exist_ok=True)
            out[name] = own
        elif "downwardAPI" in vol:
            _write_files(own, _downward(pod, vol["downwardAPI"]), None)
            out[name] = own
        else:
            kinds = sorted(k for k in vol if k != "name")
            raise ConfigError(f"volume {name!r}: unsupported type {kinds}")
    return out


def _downward(pod: Obj, source: Obj) -> dict[str, str]:
    """File path -> value for downwardAPI items (pod metadata fields only, as a kubelet)."""
    out: dict[str, str] = {}
    for item in source.get("items") or []:
        if "fieldRef" not in item:
            raise ConfigError(f"downwardAPI {item.get('path')!r}: only fieldRef is supported")
        out[item["path"]] = field_ref(item["fieldRef"]["fieldPath"], pod)
    return out


def _write_files(target: Path, data: Mapping[str, str], items: list[Obj] | None) -> None:
    target.mkdir(parents=True, exist_ok=True)
    chosen: dict[str, str] = (
        {str(i["key"]): str(i.get("path", i["key"])) for i in items}
        if items
        else {k: k for k in data}
    )
    for key, rel in chosen.items():
        if key in data:
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(data[key])


def mount_map(container: Obj, volumes: Mapping[str, Path]) -> dict[str, Path]:
    """Mount path inside the "container" -> local path, for one container."""
    out: dict[str, Path] = {}
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in volumes:
            raise ConfigError(f"volumeMount {mount['name']!r} names no volume of the pod")
        local = volumes[mount["name"]]
        if mount.get("subPath"):
            local = local / mount["subPath"]
        out[mount["mountPath"].rstrip("/") or "/"] = local
    return out


class PathRewriter:
    """Replaces mount paths that appear as whole path prefixes, longest first."""

    def __init__(self, mounts: Mapping[str, Path]) -> None:
        # A volume at "/" would match every absolute path; nothing sensible mounts there.
        self.mounts = {p: local for p, local in mounts.items() if p != "/"}
        paths = sorted(self.mounts, key=len, reverse=True)
        self._re = (
            re.compile(
                r"(?<![\w.\-/])(" + "|".join(re.escape(p) for p in paths) + r")(?=/|$|[^\w.\-])"
            )
            if paths
            else None
        )

    def __call__(self, text: str) -> str:
        if self._re is None:
            return text
        return self._re.sub(lambda m: str(self.mounts[m.group(1)]), text)
