"""The image table: which local command stands in for a container image.

An entry plays the role of the image's ENTRYPOINT and CMD, so a pod's `command` and
`args` combine with it exactly as they would with a real image. Processes share the host
network, so an entry can name the flag that chooses the listen address (`bind_flag`): the
node forces it to the pod's own 127.0.0.N address.

Extra entries can be loaded from a JSON file named by POLYKV_IMAGE_TABLE (a list of objects
with the fields of ImageCommand).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PYTHON = "{python}"  # placeholder for the interpreter running the node


@dataclass(frozen=True)
class ImageCommand:
    pattern: str  # fnmatch pattern over the image reference, registry host stripped
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...] = ()
    bind_flag: str | None = None
    env: dict[str, str] = field(default_factory=dict)


DEFAULT_TABLE: tuple[ImageCommand, ...] = (
    # The engine image runs the engine's console script (llama-server-like flags).
    ImageCommand("polykv/engine", ("polykv-engine",), bind_flag="--host"),
    ImageCommand("polykv/engine[:@]*", ("polykv-engine",), bind_flag="--host"),
    # The router image runs polykv-router (it finds the engines through the API server).
    ImageCommand("polykv/router", ("polykv-router",), bind_flag="--host"),
    ImageCommand("polykv/router[:@]*", ("polykv-router",), bind_flag="--host"),
    # The operator image runs the operator's console script (kopf run). It has no listen
    # flag of its own: the chart binds its probe and metrics ports to the pod IP.
    ImageCommand("polykv/operator", ("polykv-operator",)),
    ImageCommand("polykv/operator[:@]*", ("polykv-operator",)),
    # A tiny HTTP server for the harness's own tests and examples.
    ImageCommand(
        "polykv/testserver", (PYTHON, "-m", "polykv_testenv.testserver"), bind_flag="--host"
    ),
    ImageCommand(
        "polykv/testserver[:@]*",
        (PYTHON, "-m", "polykv_testenv.testserver"),
        bind_flag="--host",
    ),
)


class UnknownImage(LookupError):
    pass


def _strip_registry(image: str) -> str:
    first, sep, rest = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return rest
    return image


class ImageTable:
    def __init__(self, entries: Iterable[ImageCommand] = DEFAULT_TABLE) -> None:
        self.entries = list(entries)

    @classmethod
    def from_env(cls) -> ImageTable:
        table = cls()
        extra = os.environ.get("POLYKV_IMAGE_TABLE")
        if extra:
            table.entries[:0] = load(Path(extra))  # user entries win
        return table

    def lookup(self, image: str) -> ImageCommand:
        name = _strip_registry(image)
        for entry in self.entries:
            if fnmatch.fnmatchcase(name, entry.pattern):
                return entry
        raise UnknownImage(f"image {image!r} has no local command in the image table")


def load(path: Path) -> list[ImageCommand]:
    raw = json.loads(path.read_text())
    return [
        ImageCommand(
            pattern=str(e["pattern"]),
            entrypoint=tuple(e["entrypoint"]),
            cmd=tuple(e.get("cmd", ())),
            bind_flag=e.get("bind_flag"),
            env=dict(e.get("env", {})),
        )
        for e in raw
    ]


def resolve_executable(argv0: str) -> str:
    """The interpreter placeholder, then the node's own venv (console scripts such as
    polykv-engine live there even when it is not on PATH), then PATH."""
    if argv0 == PYTHON:
        return sys.executable
    if os.sep in argv0:
        return argv0
    beside = Path(sys.executable).parent / argv0
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(argv0)
    if found is None:
        raise FileNotFoundError(
            f"executable {argv0!r} not found beside {sys.executable} or on PATH"
        )
    return found


def container_argv(entry: ImageCommand, command: Sequence[str], args: Sequence[str]) -> list[str]:
    """Kubernetes' rule: `command` replaces ENTRYPOINT and drops CMD; `args` replaces CMD."""
    if command:
        return [*command, *args]
    return [*entry.entrypoint, *(args if args else entry.cmd)]


def force_bind(argv: list[str], flag: str, address: str) -> list[str]:
    """Sets `flag`'s value to `address` (both `--flag V` and `--flag=V` forms), or appends it."""
    out: list[str] = []
    found = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag and i + 1 < len(argv):
            out += [flag, address]
            found = True
            i += 2
            continue
        if arg.startswith(flag + "="):
            out.append(f"{flag}={address}")
            found = True
        else:
            out.append(arg)
        i += 1
    if not found:
        out += [flag, address]
    return out
