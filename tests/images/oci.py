"""Just enough of a container runtime to start an image's entrypoint from its OCI archive.

`unpack` applies the layers of an `oci-archive` (what `make images` writes) to a directory,
whiteouts included. `Container` runs the image's Entrypoint + Cmd (or given args) the way a
runtime would: in a private mount namespace and PID namespace, the root filesystem mounted
read-only, /proc, a tmpfs on /tmp (an emptyDir), the image's Env, its User as the uid/gid,
and extra read-only bind mounts. The host network is shared, so a server it starts is
reachable on 127.0.0.1. Needs root (unshare, mount, chroot).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UNSHARE = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private"]


@dataclass(frozen=True)
class Image:
    root: Path
    config: dict[str, Any]  # the OCI image config's "config" object
    labels: dict[str, str]
    annotations: dict[str, str]
    layers: int


def _blob(layout: Path, digest: str) -> Path:
    algo, value = digest.split(":", 1)
    return layout / "blobs" / algo / value


def _apply_layer(layer: Path, root: Path) -> None:
    with tarfile.open(layer) as tar:
        members = []
        for m in tar.getmembers():
            path = Path(m.name)
            name = path.name
            if name == ".wh..wh..opq":  # opaque directory: drop what lower layers put there
                target = root / path.parent
                if target.is_dir():
                    for child in target.iterdir():
                        _remove(child)
                continue
            if name.startswith(".wh."):
                _remove(root / path.parent / name.removeprefix(".wh."))
                continue
            members.append(m)
        tar.extractall(root, members=members, numeric_owner=True, filter="tar")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def unpack(archive: Path, dest: Path) -> Image:
    layout = dest / "layout"
    root = dest / "rootfs"
    layout.mkdir(parents=True)
    root.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(layout, filter="data")
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads(_blob(layout, index["manifests"][0]["digest"]).read_text())
    config = json.loads(_blob(layout, manifest["config"]["digest"]).read_text())
    for layer in manifest["layers"]:
        _apply_layer(_blob(layout, layer["digest"]), root)
    shutil.rmtree(layout)
    return Image(
        root=root,
        config=config["config"],
        labels=config["config"].get("Labels") or {},
        annotations=manifest.get("annotations") or {},
        layers=len(manifest["layers"]),
    )


@dataclass
class Container:
    image: Image
    args: list[str] | None = None  # replaces Cmd, as a pod's `args` does
    mounts: dict[str, Path] = field(default_factory=dict)  # path in the image -> host path
    env: dict[str, str] = field(default_factory=dict)
    command: list[str] | None = None  # replaces Entrypoint and drops Cmd, as a pod's does
    proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        cfg = self.image.config
        if self.command is not None:
            return [*self.command, *(self.args or [])]
        cmd = self.args if self.args is not None else list(cfg.get("Cmd") or [])
        return [*(cfg.get("Entrypoint") or []), *cmd]

    def script(self) -> str:
        root = shlex.quote(str(self.image.root))
        lines = ["set -e", f"R={root}"]
        # Mount points must exist before the root becomes read-only.
        for target in ("/proc", "/tmp", "/dev", *self.mounts):
            lines.append(f'mkdir -p "$R{target}"')
        lines += [
            'mount --bind "$R" "$R"',
            'mount -t proc proc "$R/proc"',
            'mount -t tmpfs -o size=64m,mode=1777 tmpfs "$R/tmp"',
            'mount --rbind /dev "$R/dev"',
        ]
        for target, host in self.mounts.items():
            lines.append(f'mount --bind {shlex.quote(str(host))} "$R{target}"')
            lines.append(f'mount -o remount,bind,ro "$R{target}"')
        lines.append('mount -o remount,bind,ro "$R"')
        user = self.image.config.get("User") or "0:0"
        env = [*(self.image.config.get("Env") or []), *(f"{k}={v}" for k, v in self.env.items())]
        argv = " ".join(shlex.quote(a) for a in self.argv())
        lines.append(
            f'exec chroot --userspec={shlex.quote(user)} "$R" /usr/bin/env -i '
            + " ".join(shlex.quote(e) for e in env)
            + f" {argv}"
        )
        return "\n".join(lines)

    def start(self, log: Path) -> Container:
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                # The PID namespace makes the entrypoint (tini) PID 1, as in a pod; killing
                # unshare kills it too (--kill-child), and with it the whole namespace.
                [*UNSHARE, "sh", "-c", self.script()],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        return self

    def run(self, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """Runs to completion; past ``timeout_s`` the container is killed (all of it)."""
        proc = subprocess.Popen(
            [*UNSHARE, "sh", "-c", self.script()],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        self.proc = proc
        try:
            out, err = proc.communicate(timeout=timeout_s)
        finally:
            self.stop()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def stop(self) -> None:
        """Kills the container: SIGKILL to its PID 1, and the kernel kills everything else in
        its PID namespace. Killing unshare is not enough: the death signal --kill-child gives
        the entrypoint is cleared when it drops to the image's user (a credential change),
        so a non-root container outlived its unshare."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(OSError, ValueError, IndexError):
            self.signal(signal.SIGKILL)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)

    def signal(self, sig: int) -> None:
        """To the container's PID 1, as `kubectl delete pod` does via the runtime."""
        assert self.proc is not None
        # unshare --fork: our child is unshare; its child is PID 1 in the namespace.
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        os.kill(int(children.split()[0]), sig)
