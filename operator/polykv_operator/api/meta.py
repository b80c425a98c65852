"""Shared pieces of the three kinds: API coordinates, the base model, conditions, references.

Field docstrings become the CRD's ``description`` (the generator reads them), so write them
for the person running ``kubectl explain``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "polykv.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CATEGORY = "polykv"


class KubeModel(BaseModel):
    """Base of every CRD model: camelCase on the wire, snake_case in Python."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        use_attribute_docstrings=True,
        # The API server already pruned unknown fields; ignoring extras keeps an operator that
        # is older than the CRD working.
        extra="ignore",
    )

    def wire(self) -> dict[str, Any]:
        """The JSON object as the API server stores it (camelCase, no nulls)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(KubeModel):
    """One aspect of the object's state, in the shape of Kubernetes' metav1.Condition."""

    type: str = Field(max_length=316)
    """Ready, Reconciling or Stalled (kstatus), or a kind-specific type."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str = Field(max_length=1024)
    """One CamelCase word a program can match on."""
    message: str = Field("", max_length=32768)
    """What happened and, when something is wrong, what to do about it."""
    last_transition_time: str
    """When the status last changed (RFC 3339)."""
    observed_generation: int | None = Field(None, ge=0)
    """The metadata.generation this condition was computed from."""


CONDITIONS_SCHEMA_EXTRA: dict[str, Any] = {
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
}


class LocalObjectReference(KubeModel):
    """A reference to an object of a known kind in the same namespace."""

    name: str = Field(min_length=1, max_length=253)
    """The object's metadata.name."""


class SecretKeySelector(KubeModel):
    """One key of a Secret in the same namespace."""

    name: str = Field(min_length=1, max_length=253)
    """The Secret's name."""
    key: str = Field(min_length=1)
    """The key inside the Secret's data."""


class LabelSelectorRequirement(KubeModel):
    """A label key, an operator and values (as in Kubernetes' LabelSelector)."""

    key: str
    """The label key."""
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    """How the key relates to the values."""
    values: list[str] | None = None
    """Values for In and NotIn; empty for Exists and DoesNotExist."""


class LabelSelector(KubeModel):
    """Selects objects by labels; all terms must hold (an empty selector selects all)."""

    match_labels: dict[str, str] | None = None
    """Labels an object must carry with exactly these values."""
    match_expressions: list[LabelSelectorRequirement] | None = None
    """Further set-based requirements."""
