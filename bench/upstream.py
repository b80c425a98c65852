"""llama-server for the benchmarks that compare against it: the builds (made once by
``bench/build_llama_server.sh`` from the llama.cpp tree the engine's wheel is built from:
upstream, with ggml's own kernels, or ``patched`` with the wheel's ggml patches), the
environment it runs in, and what its version and cache defaults are; what the engine's own
wheel was built with; and the models the servers load."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
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


PATCHES_DIR = H.REPO_ROOT / "scripts" / "patches"


def llama_server_binary(patched: bool = False) -> tuple[str | None, str]:
    """(path, "") of the llama-server built by bench/build_llama_server.sh (cached after the
    first build), or (None, why) where it cannot be built here. ``patched``: the build with
    scripts/patches/*.patch applied, as the engine's wheel has them."""
    script = H.REPO_ROOT / "bench" / "build_llama_server.sh"
    argv = [str(script), *(["--patched"] if patched else [])]
    H.progress(f"llama-server: {' '.join(argv[1:] or ['upstream'])} build (~10 min the first time)")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError as exc:
        return None, f"{script.name} could not run: {exc}"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        return None, f"{script.name} exited with {done.returncode}:\n{tail}"
    return lines[-1], ""


def llama_server_or_skip(name: str, patched: bool = False) -> str | None:
    """The llama-server binary; None, having said why the benchmark `name` is skipped, where
    it cannot be built here (the benchmark then exits 0 and publishes nothing)."""
    binary, why = llama_server_binary(patched)
    if binary is None:
        H.progress(f"SKIPPED {name}: llama-server cannot be built on this machine. {why}")
        print(f"{name}: skipped, llama-server cannot be built here (see stderr)")
    return binary


def llama_server_env(binary: str) -> dict[str, str]:
    """Its own libraries, and the OpenMP wait policy the engine beside it runs with
    (``H.SERVER_ENV``): a comparison of servers must not be one of wait policies (passive
    against libgomp's default spin made one stream of PolyKV read 2.5x slower)."""
    return {"LD_LIBRARY_PATH": str(Path(binary).parent), **H.SERVER_ENV}


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


def patch_set(paths: Sequence[Path]) -> dict[str, str]:
    """Patch name -> sha1 of its contents (the file name without .patch, as the wheel's
    manifest names it)."""
    return {p.stem: hashlib.sha1(p.read_bytes()).hexdigest()[:10] for p in sorted(paths)}


def repo_patches() -> dict[str, str]:
    """The ggml patches in this checkout (what ``--patched`` applies)."""
    return patch_set(sorted(PATCHES_DIR.glob("*.patch")))


def wheel_build() -> dict[str, Any]:
    """What the installed llama-cpp-python wheel says it was built with
    (scripts/build-llama-wheel.sh writes llama_cpp/polykv_build.json), read without loading
    libllama into this process; empty for a wheel built elsewhere."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return {}
    try:
        manifest: dict[str, Any] = json.loads(
            (Path(spec.origin).parent / "polykv_build.json").read_text()
        )
    except (OSError, ValueError):
        return {}
    return manifest


def llama_server_info(binary: str, patches: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The build's version line and the defaults of its caching options; ``patches``: the
    ggml patches it was built with (None: upstream)."""

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
        "patches": dict(patches or {}),
        "defaults": help_defaults(run("--help"), CACHE_FLAGS),
    }
