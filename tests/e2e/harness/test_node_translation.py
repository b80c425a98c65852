"""The process node's pure translations from pod spec to local process (no cluster)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from polykv_testenv.node import images
from polykv_testenv.node.images import ImageTable, UnknownImage
from polykv_testenv.node.podenv import expand
from polykv_testenv.node.volumes import PathRewriter


def test_image_table_matches_tags_digests_and_registries() -> None:
    table = ImageTable()
    for ref in (
        "polykv/engine",
        "polykv/engine:0.1",
        "polykv/engine@sha256:abc",
        "ghcr.io/polykv/engine:dev",
        "localhost:5000/polykv/engine:dev",
    ):
        assert table.lookup(ref).entrypoint == ("polykv-engine",), ref
    assert table.lookup("registry.example.com/polykv/operator:0.1.0").entrypoint == (
        "polykv-operator",
    )
    for ref in ("polykv/router", "polykv/router:0.1.0", "ghcr.io/polykv/router@sha256:abc"):
        entry = table.lookup(ref)
        assert (entry.entrypoint, entry.bind_flag) == (("polykv-router",), "--host"), ref
    with pytest.raises(UnknownImage):
        table.lookup("polykv/engine-other:1")
    with pytest.raises(UnknownImage):
        table.lookup("nginx:1.27")


def test_command_and_args_follow_kubernetes_rules() -> None:
    entry = images.ImageCommand("x", ("server",), ("--default",))
    assert images.container_argv(entry, [], []) == ["server", "--default"]
    assert images.container_argv(entry, [], ["--port", "1"]) == ["server", "--port", "1"]
    # `command` replaces the entrypoint and drops the image's default args.
    assert images.container_argv(entry, ["python"], []) == ["python"]
    assert images.container_argv(entry, ["python"], ["-c", "1"]) == ["python", "-c", "1"]


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["s", "--host", "0.0.0.0", "--port", "8"], ["s", "--host", "127.0.0.9", "--port", "8"]),
        (["s", "--host=::", "-m", "x"], ["s", "--host=127.0.0.9", "-m", "x"]),
        (["s", "--port", "8"], ["s", "--port", "8", "--host", "127.0.0.9"]),
    ],
)
def test_bind_flag_is_forced_to_the_pod_ip(argv: list[str], want: list[str]) -> None:
    assert images.force_bind(argv, "--host", "127.0.0.9") == want


def test_placeholder_and_venv_resolution() -> None:
    assert images.resolve_executable(images.PYTHON) == sys.executable
    assert images.resolve_executable("/bin/sh") == "/bin/sh"
    with pytest.raises(FileNotFoundError):
        images.resolve_executable("no-such-polykv-binary")


def test_variable_expansion() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$(MISSING)", env) == "$(MISSING)"
    assert expand("$$(A)", env) == "$(A)"


def test_mount_paths_are_rewritten_as_whole_path_prefixes() -> None:
    rewrite = PathRewriter(
        {"/models": Path("/l/m"), "/models/extra": Path("/l/x"), "/": Path("/r")}
    )
    assert rewrite("/models/a.gguf") == "/l/m/a.gguf"
    assert rewrite("/models/extra/b") == "/l/x/b"  # the longest mount wins
    assert rewrite("--model=/models/a.gguf") == "--model=/l/m/a.gguf"
    assert rewrite("/modelsx/a") == "/modelsx/a"  # not a path prefix
    assert rewrite("s3://bucket/models/a") == "s3://bucket/models/a"
    assert PathRewriter({})("/models/a") == "/models/a"


def test_containers_inherit_the_node_environment_but_not_the_harness_or_openmp_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from polykv_testenv.node.container import base_environment

    for var, value in (
        ("KUBECONFIG", "/tmp/kc"),
        ("OMP_WAIT_POLICY", "active"),
        ("GOMP_SPINCOUNT", "10000000"),
        ("POLYKV_NODE_PROBE", "kept"),
    ):
        monkeypatch.setenv(var, value)
    env = base_environment()
    assert env["POLYKV_NODE_PROBE"] == "kept"
    assert not {"KUBECONFIG", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(env)
