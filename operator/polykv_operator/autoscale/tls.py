"""TLS for the operator's external.metrics.k8s.io server: its serving certificate, and the
aggregator's client certificate checked against the front-proxy CA.

kube-apiserver proxies an aggregated request with its front-proxy client certificate
(`--proxy-client-cert-file`), signed by the request-header CA. It publishes that CA and the
allowed client names in ConfigMap kube-system/extension-apiserver-authentication
(`requestheader-client-ca-file`, `requestheader-allowed-names`). A request is the
aggregator's when its certificate chains to that CA and, if names are listed, its common name
is one of them. The user's own authorization happened in kube-apiserver before it proxied.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AUTH_CONFIGMAP = "/api/v1/namespaces/kube-system/configmaps/extension-apiserver-authentication"


class TlsError(RuntimeError):
    pass


@dataclass(frozen=True)
class FrontProxy:
    ca_pem: str
    allowed_names: frozenset[str]  # empty: any certificate the CA signed

    @classmethod
    def from_configmap(cls, data: Mapping[str, str]) -> FrontProxy:
        ca = data.get("requestheader-client-ca-file", "")
        if "-----BEGIN CERTIFICATE-----" not in ca:
            raise TlsError(
                "ConfigMap kube-system/extension-apiserver-authentication has no "
                "requestheader-client-ca-file: the API server runs without the aggregation "
                "layer (--requestheader-client-ca-file and --proxy-client-cert-file)"
            )
        try:
            names = json.loads(data.get("requestheader-allowed-names") or "[]")
        except ValueError as exc:
            raise TlsError(f"requestheader-allowed-names is not a JSON list: {exc}") from exc
        return cls(ca, frozenset(str(n) for n in names or []))

    def admits(self, peercert: Mapping[str, Any] | None) -> bool:
        """A verified client certificate (the handshake checked the chain) with an allowed
        common name."""
        if not peercert:
            return False
        if not self.allowed_names:
            return True
        return common_name(peercert) in self.allowed_names


def common_name(peercert: Mapping[str, Any]) -> str | None:
    """The subject CN of a certificate as `SSLObject.getpeercert()` gives it."""
    for rdn in peercert.get("subject") or ():
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def server_context(cert_file: Path, key_file: Path, front_proxy: FrontProxy) -> ssl.SSLContext:
    """TLS 1.2+, our certificate; a client certificate is asked for and, when sent, must
    chain to the front-proxy CA (requests without one are refused by the handler, so that a
    health probe can still connect)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert_file), str(key_file))
    except (OSError, ssl.SSLError) as exc:
        raise TlsError(f"cannot load the serving certificate {cert_file}: {exc}") from exc
    ctx.load_verify_locations(cadata=front_proxy.ca_pem)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx
