"""The images `make images` builds, started from their OCI archives as a runtime would:
read-only root, the image's non-root user, its Env, tini as PID 1 (tests/images/oci.py).

- engine: the entrypoint serves /health on the generated test model, reports the portable
  CPU backend it picked, and exits cleanly on SIGTERM sent to PID 1 (signals reach it);
- operator: the entrypoint answers --help, the chart's hook module and the operator's
  handlers import, and nothing writes to the read-only root;
- router: the entrypoint routes a completion to the engine image's container, turns ready
  once it sees that replica, and exits cleanly on SIGTERM;
- both: OCI labels and annotations, versions pinned (the Python locks), non-root user.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from polykv_testenv.waiting import free_port, wait_for

from .oci import Container, Image, unpack

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def archives() -> dict[str, Path]:
    """Builds (or finds in the cache) both images; name -> OCI archive."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("the image tests need root and unshare (as CI has)")
    out = subprocess.run(
        [str(ROOT / "scripts" / "build-images.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    paths = [Path(p) for p in out.stdout.split() if p.endswith(".oci.tar")]
    return {p.name.split("-")[1]: p for p in paths}


@pytest.fixture(scope="module")
def built() -> dict[str, Path]:
    return archives()


@pytest.fixture(scope="module")
def engine_image(built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Image:
    return unpack(built["engine"], tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def operator_image(built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Image:
    return unpack(built["operator"], tmp_path_factory.mktemp("operator"))


@pytest.fixture(scope="module")
def router_image(built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Image:
    return unpack(built["router"], tmp_path_factory.mktemp("router"))


@pytest.fixture
def engine(engine_image: Image, test_model: Path, tmp_path: Path) -> Iterator[Container]:
    port = free_port()
    c = Container(
        engine_image,
        args=["-m", f"/models/{test_model.name}", "-c", "512", "-np", "1", "-t", "1",
              "--host", "127.0.0.1", "--port", str(port), "--metrics"],
        mounts={"/models": test_model.parent},
    )  # fmt: skip
    c.port = port  # type: ignore[attr-defined]
    c.start(tmp_path / "engine.log")
    try:
        yield c
    finally:
        c.stop()
        print((tmp_path / "engine.log").read_text(errors="replace")[-3000:])


def wait_serving(c: Container, what: str, url: str) -> None:
    def serving() -> bool | None:
        assert c.proc is not None and c.proc.poll() is None, f"{what} exited"
        try:
            ok = httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return None
        return True if ok else None

    wait_for(f"{what} in the image", serving, 120, interval_s=0.5)


def test_engine_image_serves_health_and_stops_on_sigterm(engine: Container, tmp_path: Path) -> None:
    port = engine.port  # type: ignore[attr-defined]
    assert engine.proc is not None
    wait_serving(engine, "engine /health", f"http://127.0.0.1:{port}/health")
    props = httpx.get(f"http://127.0.0.1:{port}/props", timeout=5).json()
    assert props["polykv"]["boot_id"]
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert "polykv_ready 1.0" in metrics
    t0 = time.monotonic()
    engine.signal(signal.SIGTERM)
    # A graceful stop is the engine's own drain-and-exit, seen in its log and exit code; the
    # wait is a generous deadline, not the measure (a busy CI host may be slow to reap).
    code = engine.proc.wait(120)
    print(f"stopped {time.monotonic() - t0:.2f} s after SIGTERM")
    assert code == 0, f"exit {code}"
    log = (tmp_path / "engine.log").read_text(errors="replace")
    assert "shutting down: draining" in log and "stopped" in log.split("shutting down")[-1]
    assert "Read-only file system" not in log


def test_a_stopped_container_leaves_no_process_behind(engine: Container) -> None:
    """The engine runs as the image's non-root user; stopping its container (as a failed
    test's teardown does) must take every process in it, not only our unshare."""
    port = engine.port  # type: ignore[attr-defined]
    wait_serving(engine, "engine /health", f"http://127.0.0.1:{port}/health")
    assert engine.proc is not None
    pid1 = int(
        Path(f"/proc/{engine.proc.pid}/task/{engine.proc.pid}/children").read_text().split()[0]
    )
    inside = [pid1, *map(int, Path(f"/proc/{pid1}/task/{pid1}/children").read_text().split())]
    assert Path(f"/proc/{pid1}/status").read_text().count("65532") >= 2  # Uid/Gid lines
    engine.stop()
    wait_for(
        "no process of the container left",
        lambda: True if not any(Path(f"/proc/{p}").exists() for p in inside) else None,
        30,
    )


def test_operator_image_entrypoint_and_modules(operator_image: Image) -> None:
    help_run = Container(operator_image, args=["--help"]).run()
    assert help_run.returncode == 0, help_run.stderr
    assert "--all-namespaces" in help_run.stdout and "--standalone" in help_run.stdout
    code = (
        "import polykv_operator.main, polykv_operator.hooks, kopf, os; "
        "import polykv_operator.autoscale.serving_cert; "
        "print('uid', os.getuid(), 'gid', os.getgid())"
    )
    out = Container(operator_image, command=["python", "-c", code]).run()
    assert out.returncode == 0, out.stderr
    assert "uid 65532 gid 65532" in out.stdout


def test_router_image_routes_to_the_engine_image(
    engine: Container, router_image: Image, tmp_path: Path
) -> None:
    engine_port = engine.port  # type: ignore[attr-defined]
    wait_serving(engine, "engine /health", f"http://127.0.0.1:{engine_port}/health")
    port = free_port()
    router = Container(
        router_image,
        args=["--replica", f"e0=127.0.0.1:{engine_port}", "--port", str(port),
              "--host", "127.0.0.1", "--log-format", "json"],
    )  # fmt: skip
    router.start(tmp_path / "router.log")
    try:
        wait_serving(router, "router /readyz", f"http://127.0.0.1:{port}/readyz")
        body = {"prompt": "hello", "n_predict": 4, "temperature": 0, "session_id": "img-s1"}
        r = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["tokens_predicted"] == 4
        assert "polykv_router" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert router.proc is not None
        router.signal(signal.SIGTERM)
        assert router.proc.wait(30) == 0
    finally:
        router.stop()
        print((tmp_path / "router.log").read_text(errors="replace")[-3000:])
    log = (tmp_path / "router.log").read_text(errors="replace")
    assert "Read-only file system" not in log


@pytest.mark.parametrize("name", ["engine", "operator", "router"])
def test_labels_user_and_pins(name: str, request: pytest.FixtureRequest) -> None:
    image: Image = request.getfixturevalue(f"{name}_image")
    assert image.config["User"] == "65532:65532"
    assert image.config["Entrypoint"][:2] == ["/usr/bin/tini", "--"]
    assert image.labels["org.opencontainers.image.title"] == f"polykv-{name}"
    assert image.labels["org.opencontainers.image.version"] == "0.1.0"
    assert image.annotations["org.opencontainers.image.revision"]
    assert image.annotations["org.opencontainers.image.base.name"].startswith(
        "localhost/polykv-debian:bookworm-"
    )
    # Every Python distribution in the image is the locked version, and nothing else is there.
    lock = ROOT / ("engine_image" if name == "engine" else name) / "requirements.lock"
    pinned = {
        ln.split("==")[0]: ln.split("==")[1]
        for ln in lock.read_text().splitlines()
        if ln and not ln.startswith("#")
    }
    site = next((image.root / "opt/polykv/lib").glob("python3.11/site-packages"))
    found = {}
    for dist in site.glob("*.dist-info"):
        meta = (dist / "METADATA").read_text(errors="replace").splitlines()
        dname = next(m.split(": ", 1)[1] for m in meta if m.startswith("Name: "))
        version = next(m.split(": ", 1)[1] for m in meta if m.startswith("Version: "))
        found[dname.lower().replace("_", "-")] = version
    assert found.pop("polykv") == "0.1.0"
    assert found == pinned
    # Debian's package versions are recorded in the image.
    assert "tini=" in (image.root / "etc/polykv-debian.versions").read_text()
