"""Pool and session references become path segments only after the engine's own checks
(pure: no engine, no request)."""

from __future__ import annotations

import httpx
import pytest

from polykv_client import InvalidReference, InvalidRequest, PolyKVError, refs

EVIL = "../../slots/0?action=erase#"


def test_the_path_an_unchecked_name_would_have_reached() -> None:
    """Why: httpx resolves the dot segments and cuts the path at ? and #."""
    url = httpx.URL(f"http://engine/polykv/pools/{EVIL}/pin")
    assert (url.path, url.query) == ("/slots/0", b"action=erase")


@pytest.mark.parametrize(
    "ref",
    [EVIL, "..", ".", "a/b", "a?b", "a#b", "a b", "-lead", "", "x" * 254, "name\n", "é", -1, True],
)
def test_a_reference_the_engine_would_refuse_is_refused_here(ref: object) -> None:
    with pytest.raises(InvalidReference) as info:
        refs.pool_ref(ref)  # type: ignore[arg-type]
    err = info.value
    assert isinstance(err, InvalidRequest) and isinstance(err, PolyKVError)
    assert err.status is None and err.reason == "name_invalid"


@pytest.mark.parametrize("ref", ["crew", "crew.v2", "team_a:reviewers", "a" * 253, "7", 7, 0])
def test_ids_and_engine_names_pass(ref: str | int) -> None:
    url = httpx.URL("http://engine/polykv/pools/" + refs.pool_ref(ref) + "/pin")
    assert url.path == f"/polykv/pools/{ref}/pin"  # one segment, read back as it was


def test_a_new_pool_name_is_never_all_digits() -> None:
    with pytest.raises(InvalidReference):
        refs.pool_name("123")
    assert refs.pool_name("r2") == "r2"


def test_session_ids_are_encoded_and_dot_segments_refused() -> None:
    assert refs.session_id("a/b?c#d%") == "a%2Fb%3Fc%23d%25"
    url = httpx.URL("http://e/polykv/sessions/" + refs.session_id("../x"))
    assert url.raw_path == b"/polykv/sessions/..%2Fx"
    for bad in ("..", ".", "", "has space", "x" * 257, "tab\t"):
        with pytest.raises(InvalidReference):
            refs.session_id(bad)
