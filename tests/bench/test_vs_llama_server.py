"""The decode comparison's bookkeeping: ratios paired per repetition, tokens compared stream
by stream, and captions that name the build each column ran."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import upstream as U
from bench import vs_llama_server as V

MODEL = "m"


def run(rep: int, k: int, server: str, tps: float, tokens: list[list[int]]) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "rep": rep, "k": k, "server": server}
    out["decode_tps"] = tps
    if server != V.BARE:
        out |= {"tokens": tokens, "probe_ttft_s": [0.1, 0.2]}
    return out


def raw_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "env": {"cpu": "Test CPU", "cpu_count": 2, "git_commit": "abc", "date_utc": "now"},
        "llama_server": {"binary": "/c/up/bin/llama-server", "version": "1 (x)"},
        "llama_server_patched": {
            "binary": "/c/patched/bin/llama-server",
            "version": "1 (x)",
            "patches": {"ggml-a": "0123456789"},
        },
        "wheel": {"version": "0.3.36", "patches": ["ggml-a"]},
        "runs": runs,
    }


def two_reps() -> dict[str, Any]:
    """Two repetitions at 1 and 2 streams; the rates differ between repetitions so that an
    unpaired ratio would give other numbers. PolyKV's second stream at k=2 diverges."""
    same1, same2 = [[1, 2, 3]], [[1, 2, 3], [4, 5, 6]]
    runs = []
    for rep, scale in ((0, 1.0), (1, 2.0)):
        runs += [
            run(rep, 1, V.UPSTREAM, 10 * scale, same1),
            run(rep, 1, V.PATCHED, 12 * scale, same1),
            run(rep, 1, V.POLYKV, 11 * scale, same1),
            run(rep, 1, V.BARE, 11.5 * scale, []),
            run(rep, 2, V.UPSTREAM, 20 * scale, same2),
            run(rep, 2, V.PATCHED, 25 * scale, same2),
            run(rep, 2, V.POLYKV, 24 * scale, [[1, 2, 3], [4, 9, 6]]),
            run(rep, 2, V.BARE, 30 * scale, []),
        ]
    return raw_of(runs)


def cfg() -> V.Config:
    return V.Config(reps=2, levels=(1, 2), sections=("decode",), omp_policy="passive")


def test_ratios_are_paired_per_repetition() -> None:
    res = V.analyse_decode(cfg(), two_reps())[MODEL]
    ratios = res["2"]["ratios"]
    assert ratios["llama_server_patched_over_llama_server"]["values"] == [1.25, 1.25]
    assert ratios["polykv_over_llama_server_patched"]["values"] == [0.96, 0.96]
    assert ratios["polykv_over_bare_loop"]["values"] == [0.8, 0.8]
    assert res["1"]["polykv"]["values"] == [11.0, 22.0]
    assert "polykv_probe" in res["2"] and "polykv_probe" not in res["1"]  # top level only
    assert set(V.analyse(cfg(), two_reps())) == {"decode"}  # only the section measured


def test_tokens_are_compared_stream_by_stream() -> None:
    tokens = V.analyse_decode(cfg(), two_reps())[MODEL]["2"]["tokens"]
    assert tokens["llama_server_vs_llama_server_patched"] == {
        "identical": 4,
        "compared": 4,
        "first_divergence": [],
    }
    assert tokens["llama_server_patched_vs_polykv"] == {
        "identical": 2,
        "compared": 4,
        "first_divergence": [1, 1],
    }
    assert V.first_divergence([1, 2], [1, 2, 3]) == 2  # one stream cut short
    assert V.first_divergence([1, 2], [1, 2]) is None


def test_a_mismatch_at_one_stream_is_called_out() -> None:
    raw = two_reps()
    for r in raw["runs"]:
        if r["k"] == 1 and r["server"] == V.POLYKV:
            r["tokens"] = [[1, 2, 4]]
    text = V.render(cfg(), raw, {"decode": V.analyse_decode(cfg(), raw)})
    lines = dict(
        line.split(": ", 1)
        for line in text.split("Tokens, streams identical — ")[1].split("\n")[0].split("; ")
    )
    assert lines["llama-server, patched against PolyKV"] == (
        "**0/2 at 1 (diverging from token 2): a mismatch where they must agree**, "
        "2/4 at 2 (diverging from token 1)"  # at 2 streams a divergence is no fault
    )
    assert lines["llama-server, upstream against llama-server, patched"] == "2/2 at 1, 4/4 at 2"


def test_the_caption_names_the_build_of_every_column() -> None:
    raw = two_reps()
    text = V.render(cfg(), raw, {"decode": V.analyse_decode(cfg(), raw)})
    assert "same kernels" not in text
    assert "ggml's own kernels, none of our patches" in text
    assert "`bench/build_llama_server.sh --patched`: ggml-a (0123456789)" in text
    assert "llama-cpp-python 0.3.36, patches: ggml-a" in text
    assert "`bench/direct_decode.py`" in text
    assert "OpenMP wait policy `passive` for every column" in text
    assert "/c/patched/bin/llama-server" in text  # the provenance line names the binaries
    assert "--sections decode --reps 2" in text
    assert "not the patched llama-server's" not in text


def test_patches_that_differ_between_the_wheel_and_the_server_are_said() -> None:
    raw = two_reps()
    raw["wheel"]["patches"] = ["ggml-a", "ggml-b"]
    assert "ggml-a, ggml-b" in V.patches_disagree(raw)
    raw["wheel"]["patches"] = ["ggml-a"]
    assert V.patches_disagree(raw) == ""


def test_each_section_publishes_under_its_own_name() -> None:
    assert V.PUBLISHED == {"decode": "vs_llama_server", "shared": "vs_llama_server_shared"}
    assert set(V.PUBLISHED) == set(V.SECTIONS)


def test_patch_set_keys_patches_by_name_and_content(tmp_path: Path) -> None:
    a, b = tmp_path / "x-a.patch", tmp_path / "x-b.patch"
    a.write_text("one")
    b.write_text("two")
    first = U.patch_set([b, a])
    assert list(first) == ["x-a", "x-b"]
    b.write_text("three")
    assert U.patch_set([a, b])["x-b"] != first["x-b"]
    assert U.patch_set([a, b])["x-a"] == first["x-a"]


def test_the_checkout_patches_are_the_wheel_manifest_names() -> None:
    """What ``--patched`` applies is what the installed wheel was built with."""
    wheel = U.wheel_build()
    if not wheel:
        pytest.fail("the installed llama-cpp-python carries no polykv_build.json")
    assert sorted(U.repo_patches()) == sorted(wheel["patches"])
    json.dumps(wheel)  # recordable as it is


def test_a_stream_lacking_withheld_ids_is_compared_by_its_text() -> None:
    # llama-server sends no event for a token that ends inside a UTF-8 character: its id is
    # missing from the stream, its bytes arrive with the next token's text.
    full, withheld = [5, 6, 7, 8], [5, 7, 8]
    assert V.same_answer(full, withheld, "a é b", "a é b")
    assert not V.same_answer(full, withheld, "a é b", "a è b")
    # Whole streams of equal length are compared token by token, whatever their texts say.
    assert not V.same_answer([5, 6], [5, 9], "x", "x")
    # Runs published before texts were recorded compare their tokens alone.
    assert not V.same_answer(full, withheld, None, None)
    out = V.compare_tokens({0: [full, full]}, {0: [withheld, [5, 6, 7, 9]]},
                           {0: ["a é b", "a é b"]}, {0: ["a é b", "a é c"]})  # fmt: skip
    assert (out["identical"], out["compared"], out["first_divergence"]) == (1, 2, [3])


def test_upstream_may_part_at_one_stream_where_the_patches_tile_a_decoding_row() -> None:
    # With ggml-cpu-tiled-fa-runs a decoding row's attention sums in another order than
    # upstream's one-row kernel: a 1-stream mismatch against upstream is no fault then, but
    # the two patched builds must still agree.
    raw = two_reps()
    raw["wheel"] = {"patches": ["ggml-cpu-q4_1-cols", V.FA_RUNS_PATCH]}
    for r in raw["runs"]:
        if r["k"] == 1 and r["server"] in (V.PATCHED, V.POLYKV):
            r["tokens"] = [[1, 2, 4]]
    text = V.render(cfg(), raw, {"decode": V.analyse_decode(cfg(), raw)})
    lines = dict(
        line.split(": ", 1)
        for line in text.split("Tokens, streams identical — ")[1].split("\n")[0].split("; ")
    )
    assert lines["llama-server, upstream against PolyKV"].startswith(
        "0/2 at 1 (diverging from token 2), "
    )
    assert lines["llama-server, patched against PolyKV"].startswith("2/2 at 1")
    assert V.must_agree_at_one_stream(raw, V.PATCHED, V.POLYKV)
    assert not V.must_agree_at_one_stream(raw, V.UPSTREAM, V.PATCHED)
    raw["wheel"] = {"patches": ["ggml-cpu-q4_1-cols"]}
    assert V.must_agree_at_one_stream(raw, V.UPSTREAM, V.PATCHED)
