"""The external metrics API's serving certificate, as the chart's hook job makes it: a CA
that signs a certificate for the Service's names, which Python's TLS (the operator's
server, the aggregator's check) accepts."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from cryptography import x509

from polykv_operator.autoscale.serving_cert import service_names, serving_certificate


def test_the_certificate_is_for_the_service_and_chains_to_the_ca(tmp_path: Path) -> None:
    made = serving_certificate(service_names("op-external-metrics", "polykv-system"))
    cert = x509.load_pem_x509_certificate(made.cert_pem)
    ca = x509.load_pem_x509_certificate(made.ca_pem)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [
        "op-external-metrics.polykv-system.svc",
        "op-external-metrics.polykv-system.svc.cluster.local",
    ]
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # What the operator loads, and a client that trusts the CA (as the aggregator does
    # with the APIService's caBundle) dialling the Service's name: the handshake holds.
    (tmp_path / "tls.crt").write_bytes(made.cert_pem)
    (tmp_path / "tls.key").write_bytes(made.key_pem)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    client = ssl.create_default_context(cadata=made.ca_pem.decode())
    handshake(server, client, "op-external-metrics.polykv-system.svc")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server, client, "somewhere-else.polykv-system.svc")
    # Each run makes a new one: the job makes it once, when the Secret is absent.
    assert serving_certificate(["x"]).key_pem != serving_certificate(["x"]).key_pem


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, hostname: str) -> None:
    """A TLS handshake in memory; raises what the client's verification raises."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    srv = server.wrap_bio(to_server, to_client, server_side=True)
    cli = client.wrap_bio(to_client, to_server, server_hostname=hostname)
    done = {id(srv): False, id(cli): False}
    for _ in range(10):
        for end in (cli, srv):
            if not done[id(end)]:
                try:
                    end.do_handshake()
                    done[id(end)] = True
                except ssl.SSLWantReadError:
                    pass
        if all(done.values()):
            return
    raise AssertionError("the handshake did not finish")
