"""Upstream llama-server for the benchmarks that compare against it: the build (made once by
``bench/build_llama_server.sh`` from the llama.cpp tree the engine's wheel is built from),
the environment it runs in, and what its version and cache defaults are; and the models
both servers load."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import harness as H

# llama-server options whose defaults decide what it reuses between requests.
CACHE_FLAGS = (
    "--cache-prompt",
    "--cache-ram",
    "--cache-idle-slots",
    "--cache-reuse",
    "--slot-prompt-similarity",
    "--kv-unified",
)


def model_path(name: str) -> Path:
    """A model by name: "bench" (generated), else a real one from polykv-fetch-model."""
    if name == "bench":
        return H.bench_model()
    return H.real_model(name)


def llama_server_binary() -> tuple[str | None, str]:
    """(path, "") of the llama-server built by bench/build_llama_server.sh (cached after the
    first build), or (None, why) where it cannot be built here."""
    script = H.REPO_ROOT / "bench" / "build_llama_server.sh"
    H.progress("llama-server: bench/build_llama_server.sh (about 10 minutes the first time)")
    try:
        done = subprocess.run([str(script)], capture_output=True, text=True, check=False)
    except OSError as exc:
        return None, f"{script.name} could not run: {exc}"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        return None, f"{script.name} exited with {done.returncode}:\n{tail}"
    return lines[-1], ""


def llama_server_or_skip(name: str) -> str | None:
    """The llama-server binary; None, having said why the benchmark `name` is skipped, where
    it cannot be built here (the benchmark then exits 0 and publishes nothing)."""
    binary, why = llama_server_binary()
    if binary is None:
        H.progress(f"SKIPPED {name}: llama-server cannot be built on this machine. {why}")
        print(f"{name}: skipped, llama-server cannot be built here (see stderr)")
    return binary


def llama_server_env(binary: str) -> dict[str, str]:
    """Its own libraries, and its own OpenMP default (no policy of ours)."""
    return {"LD_LIBRARY_PATH": str(Path(binary).parent)}


def help_defaults(help_text: str, flags: Sequence[str]) -> dict[str, str]:
    """The ``(default: ...)`` each flag's entry in a ``--help`` listing states (up to the first
    comma), "" where an entry states none, absent where the flag is not listed."""
    entries: list[list[str]] = []
    for line in help_text.splitlines():
        if line[:1] not in ("", " "):
            entries.append([line])
        elif entries:
            entries[-1].append(line)
    out: dict[str, str] = {}
    for entry in entries:
        names = []
        for word in entry[0].split():  # "-sps,  --slot-prompt-similarity SIMILARITY  how ..."
            if word.startswith("-"):
                names.append(word.rstrip(","))
            elif not word.isupper():  # a metavariable (N, FNAME) goes on; the text stops
                break
        text = " ".join(part.strip() for part in entry)
        found = re.search(r"\(default: ([^,)]*)", text)
        for flag in flags:
            if flag in names:
                out[flag] = found.group(1).strip() if found else ""
    return out


def llama_server_info(binary: str) -> dict[str, Any]:
    """The build's version line and the defaults of its caching options."""

    def run(*args: str) -> str:
        done = subprocess.run(
            [binary, *args],
            capture_output=True,
            text=True,
            env={**os.environ, **llama_server_env(binary)},
            timeout=60,
            check=False,
        )
        return done.stdout + done.stderr

    version = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in run("--version").splitlines()
            if ln.startswith("version:")
        ),
        "?",
    )
    return {
        "binary": binary,
        "version": version,
        "defaults": help_defaults(run("--help"), CACHE_FLAGS),
    }
