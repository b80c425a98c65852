"""A minimal kopf operator for the harness's own tests: marks each Widget as seen."""

from __future__ import annotations

from typing import Any

import kopf


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # The Widget status schema is strict, so kopf's own progress lives in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage()
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage()
    settings.watching.server_timeout = 10


@kopf.on.create("smoke.polykv.io", "v1", "widgets")
def seen(spec: kopf.Spec, patch: kopf.Patch, **_: Any) -> None:
    patch.status["phase"] = "Seen"
    patch.status["observedSize"] = spec["size"]
