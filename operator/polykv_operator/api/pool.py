"""PolyKVPool: a named, immutable shared prefix materialized on every replica of an engine."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from .meta import CONDITIONS_SCHEMA_EXTRA, Condition, KubeModel, LocalObjectReference

# Bounds on every pool field. A pool's prefix is tokenized on an engine's event loop at
# each render, so the API server refuses what no context could hold long before it reaches
# an engine: 128 Ki characters is more than a 32k-token context takes (about 4 characters
# a token), and the lists are bounded like the engine's own request limits.
MAX_PREFIX_CHARS = 131_072
MAX_POOL_MESSAGES = 1_024
MAX_POOL_TOOLS = 128  # the engine's own per-request limit (OpenAI's)
MAX_POOL_TOKENS = 131_072
MAX_NAME_CHARS = 256
MAX_TOOL_CALLS = 128
MAX_OBJECT_KEYS = 64  # the top-level keys of a tool or tool call (free-form objects)
FreeObject = Annotated[dict[str, Any], Field(max_length=MAX_OBJECT_KEYS)]


class PoolMessage(KubeModel):
    """One chat message of a prefix, rendered with the model's chat template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    """Who speaks."""
    content: str = Field("", max_length=MAX_PREFIX_CHARS)
    """The message text."""
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    """Optional speaker name."""
    tool_calls: list[FreeObject] | None = Field(None, max_length=MAX_TOOL_CALLS)
    """OpenAI-style tool calls of an assistant message."""
    tool_call_id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    """The call a tool message answers."""

    def to_engine(self) -> dict[str, Any]:
        """The OpenAI chat message the engine renders."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


SOURCES = ("text", "appendText", "messages", "appendMessages", "tokens")

SPEC_RULES: list[dict[str, str]] = [
    {
        "rule": "self == oldSelf",
        "message": "a pool's spec is immutable: a changed prefix is a new pool (create one "
        "under a new name, then delete this one)",
    },
    {
        "rule": "[" + ", ".join(f"has(self.{s})" for s in SOURCES) + "].filter(x, x).size() == 1",
        "message": "give exactly one of text, appendText, messages, appendMessages or tokens",
    },
    {
        "rule": "!(has(self.appendText) || has(self.appendMessages)) || has(self.parent)",
        "message": "appendText and appendMessages extend a parent's prefix: set parent",
    },
    {
        "rule": "!has(self.branchPos) || has(self.parent)",
        "message": "branchPos is a position in the parent's prefix: set parent",
    },
    {
        "rule": "!has(self.tools) || has(self.messages)",
        "message": "tools are rendered with messages (appendMessages inherit the parent's tools)",
    },
]


class PolyKVPoolSpec(KubeModel):
    """A shared prefix. Give it exactly one way: text, appendText, messages (+ tools),
    appendMessages or tokens. The operator renders it on the engine and, when branchPos is
    absent, computes where it leaves the parent's prefix. The spec never changes."""

    engine_ref: LocalObjectReference
    """The PolyKVEngine (same namespace) whose replicas hold the pool."""
    parent: str | None = Field(None, min_length=1, max_length=253)
    """The parent PolyKVPool (same namespace and engine); absent for a root pool."""
    text: str | None = Field(None, min_length=1, max_length=MAX_PREFIX_CHARS)
    """The full prefix as plain text (tokenized like /completion's prompt)."""
    append_text: str | None = Field(None, min_length=1, max_length=MAX_PREFIX_CHARS)
    """Text appended to the parent's text prefix (the parent chain must be text)."""
    messages: list[PoolMessage] | None = Field(None, min_length=1, max_length=MAX_POOL_MESSAGES)
    """The full prefix as chat messages, rendered with the model's chat template without a
    generation prompt. A child that repeats its parent's messages and diverges later is a
    copy-free branch."""
    tools: list[FreeObject] | None = Field(None, max_length=MAX_POOL_TOOLS)
    """OpenAI-style tool definitions rendered with messages."""
    append_messages: list[PoolMessage] | None = Field(
        None, min_length=1, max_length=MAX_POOL_MESSAGES
    )
    """Messages appended to the parent's messages (the parent chain must be messages); the
    parent's tools apply."""
    tokens: list[int] | None = Field(None, min_length=1, max_length=MAX_POOL_TOKENS)
    """The full prefix as token ids of the engine's model."""
    branch_pos: int | None = Field(None, ge=1)
    """Where the prefix leaves the parent's, in tokens. Absent: the longest common token
    prefix with the parent (the parent's length extends it, shorter branches it). Given: it
    must not exceed the parent's length and the tokens before it must equal the parent's."""
    pin: bool = False
    """Keep the pool resident in KV even when nothing uses it."""

    def source(self) -> str:
        """Which of the prefix fields is set (the CRD guarantees exactly one)."""
        given = [s for s, attr in _SOURCE_FIELDS if getattr(self, attr) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(SOURCES)} (got {given or 'none'})")
        return given[0]


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


_SOURCE_FIELDS = tuple((s, _snake(s)) for s in SOURCES)  # every round asks every pool


class PoolReplica(KubeModel):
    """The pool on one engine replica."""

    pod: str
    """The engine pod."""
    pool_id: int
    """The pool's id on that replica (ids differ per replica; names do not)."""
    boot_id: str
    """The engine process the id belongs to."""
    residency: str | None = None
    """materializing, resident or evicted."""
    materialized_from: str | None = None
    """How its cells came to be on that replica: prefill, store (the replica's snapshot),
    peer (another replica's snapshot) or session."""


class PoolCapacity(KubeModel):
    """Whether a new session may attach now (the engine's admission view, worst replica)."""

    can_admit: bool
    """False when a replica would refuse or warn about a new session."""
    reason: str = ""
    """The engine's reason (e.g. "projected mean tps below floor")."""
    headroom_sessions: int = 0
    """Further sessions that fit, summed over replicas."""
    settling: bool = False
    """A replica is still measuring the effect of its last admit."""


class PolyKVPoolStatus(KubeModel):
    """The pool as declared, rendered and observed on every replica."""

    observed_generation: int | None = None
    """The metadata.generation the status was computed from."""
    conditions: list[Condition] | None = Field(None, json_schema_extra=CONDITIONS_SCHEMA_EXTRA)
    """Ready, Reconciling and Stalled (kstatus), with reasons that say what to fix."""
    prefix_len: int | None = None
    """Tokens in the full prefix [0, L)."""
    branch_pos: int | None = None
    """Tokens shared with the parent (0 for a root)."""
    depth: int | None = None
    """0 for a root, parent's depth + 1 otherwise."""
    path: str | None = None
    """root/child/... names from the root to this pool."""
    prefix_hash: str | None = None
    """The engine's chained hash of the prefix tokens."""
    replicas: list[PoolReplica] | None = None
    """Per replica: the pool id and the engine boot it belongs to."""
    sessions: int | None = None
    """Sessions attached to this pool, over all replicas."""
    mean_active_tps: float | None = None
    """Mean experienced decode tokens/s of this pool's decoding sessions."""
    own_kv_bytes: int | None = None
    """KV bytes of the pool's own range [D, L), summed over replicas."""
    subtree_kv_bytes: int | None = None
    """KV bytes of the pool, its descendants and their sessions, summed over replicas."""
    orphaned_pin: bool | None = None
    """Pinned on some replica with no sessions and no children."""
    compaction_pressure: float | None = None
    """The engine's compaction pressure in [0, 1] (highest replica)."""
    capacity: PoolCapacity | None = None
    """Admission view of a new session."""
    admission_policy: str | None = None
    """The AdmissionPolicy in effect on this pool."""
