"""The committed CRDs are what the models generate, and they are structural."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from polykv_operator import crdgen
from polykv_operator.api import KINDS

CRDS = Path(__file__).resolve().parents[2] / "crds"


def test_committed_crds_match_the_models() -> None:
    generated = crdgen.files()
    committed = {p.name: p.read_text() for p in CRDS.glob("*.yaml")}
    assert committed == generated, "run: python -m polykv_operator.crdgen"


def test_check_mode_reports_drift(tmp_path: Path) -> None:
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 1
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 0


def walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        out.append((path, node))
        for k, v in node.get("properties", {}).items():
            out += walk(v, f"{path}.{k}")
        if isinstance(node.get("items"), dict):
            out += walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schemas_are_structural() -> None:
    for kind in KINDS:
        schema = crdgen.crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in walk(schema):
            assert not {"$ref", "anyOf", "allOf", "oneOf", "title", "$defs"} & set(node), path
            assert node.get("additionalProperties") is not False, path
            assert node.get("type") or node.get("x-kubernetes-preserve-unknown-fields"), path
            if "exclusiveMinimum" in node:
                assert isinstance(node["exclusiveMinimum"], bool), path


def test_pool_crd_shape() -> None:
    crd = yaml.safe_load((CRDS / "polykvpools.polykv.io.yaml").read_text())
    spec = crd["spec"]
    assert spec["group"] == "polykv.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["categories"] == ["polykv"]
    assert "kvpool" in spec["names"]["shortNames"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"].upper() for c in version["additionalPrinterColumns"]]
    assert columns == ["PATH", "LEN", "D", "SESSIONS", "TPS", "PRESSURE", "READY", "AGE"]
    pool_spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = [r["rule"] for r in pool_spec["x-kubernetes-validations"]]
    assert "self == oldSelf" in rules
    assert pool_spec["properties"]["branchPos"]["description"].startswith("Where the prefix")
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
        "conditions"
    ]
    assert conditions["x-kubernetes-list-type"] == "map"


def test_engine_has_scale_subresource() -> None:
    crd = yaml.safe_load((CRDS / "polykvengines.polykv.io.yaml").read_text())
    scale = crd["spec"]["versions"][0]["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def test_admission_policy_says_what_it_is() -> None:
    crd = yaml.safe_load((CRDS / "admissionpolicies.polykv.io.yaml").read_text())
    desc = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"]
    assert "ValidatingAdmissionPolicy" in desc
