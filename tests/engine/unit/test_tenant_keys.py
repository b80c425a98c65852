"""Tenant keys: the key-file format, tenant assignment, and the boot rules in the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from polykv_engine.cli import config_from_args
from polykv_engine.http.tenants import (
    Identity,
    KeyEntry,
    KeyFileError,
    assign_tenants,
    key_matches,
    parse_key_file,
    tenant_of,
)


def test_key_file_lines_plain_named_comments_and_blanks() -> None:
    text = "# keys\n\nplain-key-1\n  alpha: k-a1\nalpha:\tk-a2\nbeta: k-b\nplain:with:colons\n"
    assert parse_key_file(text) == [
        KeyEntry("plain-key-1", None),
        KeyEntry("k-a1", "alpha"),
        KeyEntry("k-a2", "alpha"),
        KeyEntry("k-b", "beta"),
        KeyEntry("plain:with:colons", None),  # llama-server's format: the line is the key
    ]


def test_a_bad_line_is_named_by_number_never_by_its_secret() -> None:
    with pytest.raises(KeyFileError) as err:
        parse_key_file("good\nnot a key s3cr3t\n")
    assert "line 2" in str(err.value) and "s3cr3t" not in str(err.value)


def test_each_unnamed_key_is_its_own_tenant_and_names_group_keys() -> None:
    pairs = dict(assign_tenants(parse_key_file("k1\nk2\nteam: k3\nteam: k4\n")))
    assert len({pairs["k1"], pairs["k2"], pairs["k3"]}) == 3
    assert pairs["k3"] == pairs["k4"]
    assert tenant_of("k4", list(pairs.items())) == pairs["k3"]
    assert tenant_of("nope", list(pairs.items())) is None


def test_key_bytes_that_are_not_utf8_compare_without_raising() -> None:
    surrogate = b"\xff\xfe".decode("utf-8", "surrogateescape")  # how aiohttp keeps them
    assert not key_matches(surrogate, ("key",))
    assert tenant_of(surrogate, [("key", "t")]) is None


def test_identity_sees_its_own_tenant_and_the_admin_everything() -> None:
    alpha = Identity("tenant:alpha")
    assert alpha.sees("tenant:alpha") and not alpha.sees("tenant:beta") and not alpha.trusted
    assert Identity("admin", admin=True).sees("tenant:beta")
    assert Identity("tenant:beta", router=True).trusted


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"  # the CLI only checks the file exists before it boots
    path.write_bytes(b"GGUF")
    return path


def test_several_tenants_without_an_admin_key_refuse_to_boot(
    model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POLYKV_ADMIN_KEY", raising=False)
    monkeypatch.delenv("LLAMA_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        config_from_args(["-m", str(model), "--api-key", "k1", "--api-key", "k2"])
    assert exit_.value.code == 2
    assert "2 tenants and no --polykv-admin-key" in capsys.readouterr().err


def test_one_tenants_keys_are_the_admins_without_an_admin_key(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POLYKV_ADMIN_KEY", raising=False)
    monkeypatch.delenv("LLAMA_API_KEY", raising=False)
    monkeypatch.setenv("POLYKV_ROUTER_KEY", "router-secret")
    keys = tmp_path / "api.keys"
    keys.write_text("crew: k1\ncrew: k2\n")
    _, settings, _ = config_from_args(["-m", str(model), "--api-key-file", str(keys)])
    assert settings.api_keys == ("k1", "k2") == settings.admin_keys
    assert len({t for _, t in settings.key_tenants}) == 1
    assert settings.router_keys == ("router-secret",)
    _, settings, _ = config_from_args(
        ["-m", str(model), "--api-key", "k1", "--api-key", "k2", "--polykv-admin-key", "adm"]
    )
    assert settings.admin_keys == ("adm",) and len(set(dict(settings.key_tenants).values())) == 2
