"""The docs site and the front page: the site builds in strict mode (a broken link, a missing
page or a missing anchor fails), generated pages are current, and the front page stays a
front page whose links all land."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FRONT_PAGE_LIMIT = 15_000  # bytes: a pitch, a path, a map and links; the rest is docs/


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "crd-reference" / "index.html").is_file()


def test_generated_pages_are_current() -> None:
    reference = load_script("docs_reference")
    for path, text in reference.pages().items():
        assert path.read_text() == text, f"run: python scripts/docs_reference.py ({path.name})"


def test_the_crd_reference_names_every_spec_field() -> None:
    reference = load_script("docs_reference")
    page = reference.crd_page()
    for crd in sorted((ROOT / "crds").glob("*.yaml")):
        schema = yaml.safe_load(crd.read_text())["spec"]["versions"][0]["schema"]
        for field in schema["openAPIV3Schema"]["properties"]["spec"]["properties"]:
            assert f"`spec.{field}`" in page, (crd.name, field)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {slugify(h, "-") for h in re.findall(r"^#+ (.+?)\s*$", text, re.M)}


def test_the_front_page_is_short_and_its_links_land() -> None:
    text = README.read_text()
    assert len(text.encode()) <= FRONT_PAGE_LIMIT
    assert "bench:" not in text, "benchmark tables belong in docs/performance.md"
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert links
    for target, anchor in links:
        if "://" in target:
            continue
        path = ROOT / target
        assert path.exists(), target
        if anchor:
            assert anchor in anchors(path), f"{target}#{anchor}"


def test_no_history_terms_without_their_meaning() -> None:
    """Words that only the project's past explains ("issue 14", "P7") stay out of the pages a
    newcomer reads."""
    pages = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        found = re.findall(r"\b(?:[Ii]ssue[ -]\d+|P\d+\b)", page.read_text())
        assert not found, (page.name, found)


def test_every_benchmark_has_its_place_on_the_performance_page() -> None:
    tree = ast.parse((ROOT / "bench" / "run_all.py").read_text())
    (names,) = (
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "BENCHMARKS"
    )
    page = (ROOT / "docs" / "performance.md").read_text()
    for name in names:
        assert f"<!-- bench:{name}:start -->" in page, name
        assert f"<!-- bench:{name}:end -->" in page, name


def test_precommit_runs_what_ci_runs() -> None:
    """The hooks call the same tools, with the same configuration, as `make lint typecheck`."""
    hooks = {
        h["id"]: h["entry"]
        for repo in yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"]
        for h in repo["hooks"]
    }
    makefile = (ROOT / "Makefile").read_text()
    for tool_args, hook in (
        ("ruff check .", "ruff-check"),
        ("ruff format --check .", "ruff-format"),
        ("mypy", "mypy"),
    ):
        assert f"$(VENV)/bin/{tool_args}\n" in makefile, tool_args
        assert hooks[hook].startswith(".venv/bin/" + tool_args.removesuffix(" .")), hook


def test_the_front_page_ratios_are_the_measured_ones() -> None:
    """The headline ratios, read again from the results files the benchmarks wrote: a
    re-run that moves one fails here until the front page says the new figure."""
    results = ROOT / "bench" / "results"
    crew = json.loads((results / "agent_crew.json").read_text())["summary"]
    vs = json.loads((results / "vs_llama_server_shared.json").read_text())["summary"]
    vs |= json.loads((results / "vs_llama_server.json").read_text())["summary"]
    ramp = json.loads((results / "spawn_ramp.json").read_text())["summary"]["policies"]

    def med(path: str, summary: dict[str, Any] = vs) -> float:
        node: Any = summary
        for key in path.split("/"):
            node = node[key]
        return float(node["median"] if isinstance(node, dict) else node)

    pool, auto = "shared/{}/fanout/polykv_pool/", "shared/{}/fanout/polykv_auto/"
    bench, smol = "bench", "smollm2-135m-instruct-q4_1"
    naive, shipped = med("naive-raw/under_s", ramp), med("p7/under_s", ramp)
    expected = [
        f"**{med('llama_server_over_polykv/wall_s', crew):.2f}×**",
        f"**{med('llama_server_over_polykv/largest_gap_s', crew):.0f}×** "
        f"({med('llama_server/largest_gap_s', crew):.1f} s → "
        f"{med('polykv/largest_gap_s', crew):.2f} s)",
        f"**{med('llama_server_over_polykv/kv_cells_peak', crew):.1f}×**",
        f"**{med(pool.format(bench) + 'sooner_median'):.0f}×** "
        f"({med(pool.format(smol) + 'sooner_median'):.0f}×)",
        f"**{med(pool.format(bench) + 'less_kv'):.1f}×**",
        f"**{med(auto.format(bench) + 'sooner_median'):.1f}×** "
        f"({med(auto.format(smol) + 'sooner_median'):.1f}×)",
        f"**{med(f'decode/{bench}/8/ratios/polykv_over_llama_server'):.2f}×** "
        f"({med(f'decode/{smol}/8/ratios/polykv_over_llama_server'):.2f}×)",
        f"**{naive / shipped:.1f}×** less ({naive:.1f} s → {shipped:.1f} s)",
    ]
    text = README.read_text()
    for cell in expected:
        assert cell in text, cell
