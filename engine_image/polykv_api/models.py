"""The PolyKV wire contract: every request and response body the engine speaks.

This module is the single source of truth for field names, types and defaults. The engine
parses requests with it, the operator and the tests read responses with it, and the engine's
OpenAPI document is generated from it. It must never import llama_cpp or kopf.

Request models accept unknown fields (llama-server clients send many we do not use); the
engine reports them back in the ``X-PolyKV-Ignored-Fields`` header instead of dropping them
silently.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from polykv_api.limits import (
    INT32_MAX,
    MAX_DRAFT,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TOOLS,
)

TokenId = Annotated[int, Field(ge=0)]
# Request models are strict: JSON `true` is not token 1 and "5" is not 5. A client that
# sends the wrong type learns it from a 400 instead of getting a guess.
SESSION_ID_PATTERN = r"^[!-~]{1,256}$"
"""A session id travels in headers (x-session-id, echoed back): visible ASCII only."""
POOL_NAME_PATTERN = r"^(?=.*[^0-9])[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$"
"""A pool name: letters, digits, '.', '_', ':', '-', a letter or digit first, never all
digits (a string of digits is a pool id). The engine's rule, which clients check too."""


def supported_types(kind: str, value: Any, allowed: tuple[str, ...], why: str = "") -> Any:
    """``value`` unchanged; a ValueError naming the first entry of a list whose ``type`` is
    not ``allowed`` (instead of pydantic's complaint about every member of a union)."""
    if isinstance(value, list):
        for entry in value:
            found = entry.get("type") if isinstance(entry, dict) else None
            if isinstance(found, str) and found not in allowed:
                raise ValueError(
                    f"{kind} type {found!r} is not supported (supported: {', '.join(allowed)}){why}"
                )
    return value


def _stop_schema(schema: dict[str, Any]) -> None:
    """``stop`` as clients send it: a list, one string or null (read as a list: the
    validator below), so the published schema refuses nothing the engine accepts."""
    array = {k: v for k, v in schema.items() if k != "title"}
    one = {"type": "string", "maxLength": MAX_STOP_CHARS}
    schema.clear()
    schema.update({"title": "Stop", "anyOf": [array, one, {"type": "null"}]})


class _Request(BaseModel):
    """An inference body: OpenAI clients send many fields we do not use, so unknown fields
    are accepted and reported back in ``X-PolyKV-Ignored-Fields`` (never dropped silently)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, strict=True)

    def ignored_fields(self) -> list[str]:
        """Names of body fields this engine does not understand (echoed, never silent)."""
        return sorted((self.model_extra or {}).keys())


class _Control(BaseModel):
    """A control body (``/polykv/*``, ``/tokenize``, ``/detokenize``): a misspelt field must
    not silently install something else, so unknown fields are refused with 400."""

    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingFields(_Request):
    """Generation settings shared by every completion route (llama-server names)."""

    temperature: float = Field(0.8, ge=0.0, le=100.0)
    top_k: int = Field(40, ge=0, le=INT32_MAX)
    top_p: float = Field(0.95, ge=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    seed: int = Field(-1, ge=-1, le=2**32 - 1, description="-1 picks a random seed")
    repeat_penalty: float = Field(1.0, ge=0.0)
    repeat_last_n: int = Field(
        64, ge=-1, le=INT32_MAX, description="at most the slot's context; -1: all of it"
    )
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOPS, json_schema_extra=_stop_schema
    )
    ignore_eos: bool = False
    stream: bool = False
    cache_prompt: bool = True
    session_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        pattern=SESSION_ID_PATTERN,
        description="Continuation key (visible ASCII, no spaces); the x-session-id header is "
        "an alternative",
    )
    id_slot: int = Field(-1, ge=-1, le=INT32_MAX)
    overcommit: bool = False
    pool_id: int | str | None = Field(None, description="attach to this pool (id or name)")
    shared_pool_slot: int | None = Field(
        None, ge=0, le=INT32_MAX, description="legacy alias of pool_id"
    )
    shared_prefix_n_tokens: int | None = Field(
        None,
        ge=1,
        le=INT32_MAX,
        description="explicit shared prefix length P; default: computed (auto-P)",
    )
    spec_type: Literal["none", "ngram", "draft"] | None = Field(
        None,
        alias="speculative.type",
        description="speculative decoding for this request: ngram drafts from the context "
        "(prompt lookup), draft with the engine's draft model (-md), none turns it off; "
        "default: the engine's --spec-type",
    )
    spec_n_max: int | None = Field(
        None,
        ge=0,
        le=MAX_DRAFT,
        alias="speculative.n_max",
        description="most tokens drafted a step (llama-server's name)",
    )
    spec_n_min: int | None = Field(
        None,
        ge=0,
        le=MAX_DRAFT,
        alias="speculative.n_min",
        description="fewest tokens worth a draft (llama-server's name)",
    )

    def pool_ref(self) -> int | str | None:
        return self.pool_id if self.pool_id is not None else self.shared_pool_slot

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value


PromptPart = str | int


class CompletionRequest(SamplingFields):
    """``POST /completion`` (llama-server native)."""

    prompt: str | list[PromptPart]
    n_predict: int = Field(
        -1, ge=-1, le=INT32_MAX, description="-1 generates until EOS or the context ends"
    )
    max_tokens: int | None = Field(
        None, ge=0, le=INT32_MAX, description="alias of n_predict (llama-server)"
    )
    max_completion_tokens: int | None = Field(
        None, ge=0, le=INT32_MAX, description="alias of n_predict"
    )
    n_probs: int = Field(
        0, ge=0, le=20, description="log-probabilities of the N most likely tokens per step"
    )
    grammar: str | None = Field(None, min_length=1, description="GBNF the output must match")
    json_schema: dict[str, Any] | None = Field(
        None, description="JSON Schema the output must validate against"
    )

    def limit(self) -> int:
        """Tokens to generate: n_predict, else its aliases (as llama-server reads them)."""
        if self.n_predict != -1:
            return self.n_predict
        for alias in (self.max_completion_tokens, self.max_tokens):
            if alias is not None:
                return alias
        return -1

    @field_validator("prompt")
    @classmethod
    def _prompt_tokens_valid(cls, value: str | list[PromptPart]) -> str | list[PromptPart]:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be an empty list")
            if any(isinstance(p, int) and p < 0 for p in value):
                raise ValueError("token ids must be >= 0")
        return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class OAICompletionRequest(SamplingFields):
    """``POST /v1/completions`` (OpenAI legacy completions)."""

    model: str | None = None
    prompt: str | list[PromptPart] | list[str]
    max_tokens: int | None = Field(
        None, ge=0, le=INT32_MAX, description="absent: until EOS (llama-server)"
    )
    n: int = Field(1, ge=1, le=1, description="only one choice per request is supported")
    echo: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(
        None, ge=0, le=20, description="log-probabilities of the N most likely tokens per step"
    )

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be an empty list")
            if len(value) > 1 and all(isinstance(p, str) for p in value):
                raise ValueError("only one prompt per request is supported")
            if len(value) == 1 and isinstance(value[0], str):
                return value[0]
        return value


class TextPart(BaseModel):
    """A content part; only text parts are supported (no images or audio)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        # Name the unsupported part instead of pydantic's union-by-union complaints.
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"only text content parts are supported (got a {kind!r} part): this "
                        "engine serves text models"
                    )
        return value

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(BaseModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True, strict=True)


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``: free text, any JSON object, or JSON valid against a
    schema; the JSON modes are enforced by a grammar, so the reply always parses."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="llama-server's shorthand for json_object + schema"
    )

    model_config = ConfigDict(populate_by_name=True, strict=True)

    @model_validator(mode="after")
    def _schema_when_needed(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None and self.schema_ is None:
            raise ValueError('type "json_schema" needs a json_schema object with a schema')
        return self

    def schema_field(self) -> tuple[dict[str, Any] | None, str]:
        """The schema to enforce (None: any JSON object) and the field it came from."""
        if self.json_schema is not None:
            return self.json_schema.schema_, "response_format.json_schema.schema"
        return self.schema_, "response_format.schema"


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``; the prompt is rendered with the model's chat template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto", "required" or {"type": "function", "function": {...}}'
    )
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    n: int = Field(1, ge=1, le=1, description="only one choice per request is supported")
    response_format: ResponseFormat | None = None
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)


class ApplyTemplateRequest(_Control):
    """``POST /apply-template`` (llama-server): the chat template applied, no inference."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Control):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Control):
    tokens: list[TokenId]


# --------------------------------------------------------------------------- responses


class Timings(BaseModel):
    """Per-response timings, llama-server compatible."""

    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    cache_n: int = Field(description="prompt tokens reused from the KV cache, not recomputed")
    draft_n: int | None = Field(None, description="tokens speculative decoding drafted")
    draft_n_accepted: int | None = Field(
        None, description="drafted tokens kept: each a decode step saved"
    )


class PolykvResponseInfo(BaseModel):
    """The ``polykv`` block of a completion response (headers carry the same for clients
    that drop unknown body fields)."""

    session_id: str | None
    slot: int
    tps_ewma: float
    pool_id: int | None
    shared_prefix_tokens: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from KV (pool or session)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the model's JSON text of the arguments")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    """``POST /v1/chat/completions`` (not streamed)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings
    polykv: PolykvResponseInfo


class LegacyLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: LegacyLogprobs | None
    finish_reason: Literal["stop", "length"]


class TextCompletion(BaseModel):
    """``POST /v1/completions`` (not streamed)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[TextChoice]
    usage: Usage
    timings: Timings
    polykv: PolykvResponseInfo


class NativeTopProb(BaseModel):
    id: int
    token: str
    bytes: list[int]
    logprob: float


class NativeProb(NativeTopProb):
    top_logprobs: list[NativeTopProb]


class NativeCompletion(BaseModel):
    """``POST /completion`` (not streamed), llama-server's shape."""

    index: int
    content: str
    tokens: list[int]
    id_slot: int
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: dict[str, Any]
    has_new_line: bool
    truncated: bool
    stop_type: Literal["eos", "word", "limit", "none"]
    stopping_word: str
    tokens_cached: int
    timings: Timings
    session_id: str | None
    polykv: PolykvResponseInfo
    completion_probabilities: list[NativeProb] | None = None


Reason = Literal[
    # request shape
    "invalid_request",
    "invalid_json",
    "unknown_fields",
    "unsupported_media_type",
    "body_too_large",
    "route_not_found",
    "method_not_allowed",
    "token_invalid",
    "template_error",
    "prompt_too_long",
    "not_supported",
    # bounds (polykv_api.limits)
    "json_too_deep",
    "grammar_too_large",
    "schema_too_large",
    "limit_exceeded",
    # keys
    "unauthorized",
    "forbidden",
    # pools and sessions
    "pool_not_found",
    "name_invalid",
    "name_conflict",
    "prefix_empty",
    "prefix_mismatch",
    "no_common_prefix",
    "branch_pos_invalid",
    "prefix_too_long",
    "seq_ids_exhausted",
    "has_children",
    "pool_pinned",
    "pool_in_use",
    "pool_materializing",
    "pool_released",
    "parent_failed",
    "pools_disabled",
    "recurrent_branch",  # a fork below the parent's length on a recurrent/hybrid model
    "recurrent_attach",  # an attach below the pool's length on a recurrent/hybrid model
    "session_not_found",
    "session_empty",
    "session_busy",
    "response_not_found",  # previous_response_id: unknown, released with its session, or evicted
    "slot_not_found",
    "slot_busy",
    "snapshot_not_found",  # GET /polykv/snapshots/{digest}: this replica holds no such file
    "snapshots_disabled",  # the engine runs without --polykv-snapshot-dir
    # admission and load
    "tps_floor",
    "kv_headroom",
    "context_headroom",
    "settling",
    "prefill",
    "kv_full",
    "queue_full",
    "loading",
    "shutting_down",
    "no_replica",  # polykv-router: no replica could take the request (none serving or reachable)
    # the engine's own fault
    "decode_failed",
    "internal",
]
"""Stable machine-readable refusal codes: programs match these, never ``message`` text."""

REASONS: tuple[str, ...] = Reason.__args__  # type: ignore[attr-defined]


class ErrorDetail(BaseModel):
    code: int = Field(description="the HTTP status")
    message: str = Field(description="for people; wording may change between versions")
    type: str = Field(description="llama-server / OpenAI error class, e.g. conflict_error")
    reason: Reason = Field(description="stable code for programs: match this, not the message")


class ErrorBody(BaseModel):
    error: ErrorDetail


class SessionTps(BaseModel):
    session_id: str | None
    slot: int
    pool_id: int | None = None
    state: Literal["idle", "prefill", "decoding"]
    tps_ewma: float = Field(description="experienced decode tokens/s of the current turn")
    warming: bool
    ctx_used: int
    ctx_total: int
    ctx_headroom_tokens: int
    draft_n: int = Field(0, description="tokens speculative decoding drafted in the turn")
    draft_n_accepted: int = Field(
        0, description="of those, kept: tps_ewma counts them, each a step saved"
    )


SessionKV = Literal["slot", "parked", "stored"]


class SessionInfo(BaseModel):
    """``GET /polykv/sessions/{id}``: where a session's KV lives on this replica (a router
    asks every replica after a restart instead of keeping a shared table)."""

    session_id: str
    boot_id: str = Field(
        description="changes when the engine restarts (its KV is then gone, unless the "
        "session's cache was saved: kv says stored)"
    )
    slot: int | None = Field(description="the slot holding it; null while its cache is stored")
    state: Literal["idle", "prefill", "decoding"]
    kv: SessionKV = Field(
        "slot",
        description="where the session's cache is: slot (in the KV cache), parked (its tail "
        "in host memory while the slot is idle; put back at its next turn), stored (on disk, "
        "saved by the engine process before this one at shutdown; restored at its next turn)",
    )
    pool_id: int | None
    pool_name: str | None
    ctx_used: int
    ctx_headroom_tokens: int
    tps_ewma: float


class TpsSnapshot(BaseModel):
    """``GET /polykv/tps``: one JSON object, or one SSE event every interval."""

    ts: float
    aggregate_tps: float = Field(description="decoded tokens/s across all sessions (EWMA)")
    prefill_tps: float = Field(description="prompt tokens/s processed (EWMA), apart from decode")
    mean_active_tps: float = Field(description="mean tps_ewma over decoding, non-warming sessions")
    n_active: int
    n_warming: int
    sessions: list[SessionTps]


class CpuBackend(BaseModel):
    """The ggml CPU backend this engine runs on, from the backend's own report."""

    variant: str | None = Field(
        description="the per-CPU build picked for this machine (e.g. haswell, zen4); "
        "null when the CPU backend is linked in"
    )
    features: dict[str, str] = Field(description="instruction sets it uses, e.g. AVX2: 1")
    extra_buffer_types: list[str] = Field(description="weight layouts beyond the file's")
    repack: bool = Field(description="weights repacked into an extra buffer type (--no-repack)")
    amx: bool = Field(description="AMX kernels present (never in PolyKV's own build)")
    patches: list[str] = Field(
        description="PolyKV's patches to the vendored llama.cpp in this build "
        "(scripts/patches; speed only: each result is bit for bit what one of ggml's own "
        "kernels computes); empty for another build"
    )
    kernel_paths: list[str] = Field(
        description="the patched kernel paths that run here (q4_1_rows, q4_1_cols, q4_K_cols, "
        "q6_K_cols, q5_1_cols, fa_runs, q5_0_cols, q8_0_cols): by default those measured to "
        "win on this CPU family in this variant, or the ones POLYKV_GGML_PATHS names; "
        "elsewhere ggml's own kernels run"
    )
    threads: int = Field(
        description="compute threads for decoding (-t; by default the cores "
        "this process may use: its CPU set's physical cores, capped by its CPU limit)"
    )
    threads_batch: int = Field(description="compute threads for prompt processing (-tb)")
    omp_wait: str = Field(
        description="how those threads wait between graphs: spin, passive, "
        "active or default (POLYKV_OMP_WAIT_POLICY; auto picks spin only when every thread "
        "has a CPU of its own), custom for OMP_WAIT_POLICY/GOMP_SPINCOUNT given directly"
    )
    cpu_limit: float | None = Field(
        description="the cgroup's CPU limit in CPUs (CFS quota); null when there is none"
    )


class KvMemory(BaseModel):
    """What the model keeps per sequence, and what that means for pools."""

    kind: Literal["attention", "sliding_window", "recurrent", "hybrid"] = Field(
        description="attention: every layer keeps every token's cells; sliding_window: some "
        "layers attend to the last sliding_window tokens only; recurrent: one fixed-size "
        "state per sequence, no cells; hybrid: both a state and attention cells"
    )
    sliding_window: int = Field(description="the window in tokens (0: none)")
    swa_full: bool = Field(
        description="the window layers keep every cell, like the others (llama-server's "
        "--swa-full); the engine turns it on itself when it serves pools on such a model"
    )
    swa_full_extra_bytes: int = Field(
        description="what that costs beyond a window-sized cache for the same -c and -np"
    )
    recurrent_state_bytes: int = Field(
        description="bytes of one sequence's recurrent state (each pool and each session "
        "holding a context has one)"
    )
    pools: str = Field(description="how pools work on this memory, or why this engine serves none")


class PolykvProps(BaseModel):
    """The ``polykv`` block of ``GET /props``."""

    boot_id: str
    version: str
    n_parallel: int
    max_pools: int
    seq_ids_max: int
    kv_unified: bool
    n_ctx: int
    n_ctx_slot: int
    kv_bytes_per_token: int
    tps_window_tokens: int
    tps_window_seconds: float
    tps_stream_interval_ms: int
    context_shift: bool
    cpu_backend: CpuBackend
    memory: KvMemory


# --------------------------------------------------------------------------- pools

PoolRef = int | str
"""A pool id (per engine replica) or the pool's name (the same on every replica)."""

PoolSource = Literal["prefill", "store", "peer", "session"]
"""How a pool's own cells came to be on a replica: computed (prefill), read from this
replica's snapshot store, fetched from a peer replica's, or shared from a live session."""

SnapshotRefusal = Literal[
    "too_large",  # bigger than this engine accepts for that many tokens, or than the store
    "truncated",  # shorter than its header says
    "corrupt",  # a wrong magic, an unreadable header, a checksum that does not match
    "other_model",  # written by an engine running another model file
    "other_build",  # another llama.cpp build, or another snapshot format
    "other_layout",  # other cache types, attention kernel or streams
    "other_prefix",  # cells of other tokens (a file under a name it should not have)
    "other_branch",  # a pool's cells from another branch point than the one planned
    "no_room",  # the KV cache has no free cells for them
    "parent_not_resident",  # the parent pool's cells are not in the cache to build on
    "rejected",  # llama.cpp refused the bytes, or they held other positions
    "peer_failed",  # the peer could not be reached, answered an error, or broke off
]
"""Why a KV snapshot was not restored (``polykv_snapshot_refusals_total{reason}``)."""

# A peer replica's base URL: scheme, host and port, nothing else (no path, user or query).
PEER_URL_PATTERN = r"^https?://([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?$"


class PoolPrefix(_Control):
    """Exactly one way to give a pool's prefix."""

    tokens: list[TokenId] | None = Field(None, min_length=1)
    prompt: str | None = Field(None, min_length=1, description="text, tokenized like /completion")
    messages: list[ChatMessage] | None = Field(
        None,
        min_length=1,
        max_length=MAX_MESSAGES,
        description="rendered with the model's chat template, without a generation prompt: "
        "the system block a later /v1/chat/completions attach shares",
    )
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    from_session: str | None = Field(
        None, min_length=1, description="snapshot a live session's context (no recompute)"
    )
    name: str | None = Field(None, min_length=1, max_length=253)
    pin: bool = False
    dry_run: bool = Field(False, description="validate and report, create nothing")
    restore_peer: str | None = Field(
        None,
        max_length=256,
        pattern=PEER_URL_PATTERN,
        description="a replica of the same engine (http://host:port) to fetch this pool's KV "
        "snapshot from when this replica's own store has none; prefilled when neither has it",
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> PoolPrefix:
        given = [
            k
            for k in ("tokens", "prompt", "messages", "from_session")
            if getattr(self, k) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of tokens, prompt, messages or from_session"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.tools is not None and self.messages is None:
            raise ValueError("tools are rendered with messages; give messages too")
        return self


class PoolCreateRequest(PoolPrefix):
    """``POST /polykv/pools``: a root pool."""


class PoolForkRequest(PoolPrefix):
    """``POST /polykv/pools/{id}/fork``: the child's FULL prefix [0, L); D defaults to the
    longest common prefix with the parent (== parent's length: extend; shorter: branch)."""

    branch_pos: int | None = Field(None, ge=1)


class PoolSession(BaseModel):
    session_id: str | None
    slot: int
    shared_prefix_tokens: int = Field(description="leading positions whose cells are the pool's")
    suffix_n_tokens: int
    marginal_kv_bytes: int = Field(description="bytes of KV cells only this session holds")
    tps_ewma: float
    ttft_ms: float | None = Field(None, description="the last turn's time to first token")
    implicit_shared_tokens: int = Field(
        0, description="positions whose cells another session holds too (automatic sharing)"
    )
    state: Literal["idle", "prefill", "decoding"]


AdmissionReason = Literal[
    "ok", "guaranteed", "settling", "prefill", "tps_floor", "kv_headroom", "context_headroom"
]
"""``Capacity.reason_code``: why one more session may or may not join (``ok`` admits)."""


class CapacitySummary(BaseModel):
    """The admission verdict in brief, so one pool listing carries it for every pool."""

    can_admit: bool
    reason: str
    reason_code: AdmissionReason = "ok"
    headroom_sessions: int
    settling: bool
    compaction_pressure: float


class PoolStatus(BaseModel):
    pool_id: int
    name: str | None
    parent: int | None
    parent_name: str | None
    branch_pos: int
    prefix_len: int
    prefix_hash: str = Field(description="chained xxhash64 of tokens [0, L), hex")
    own_kv_bytes: int = Field(description="KV bytes of cells this pool owns: its [D, L) range")
    subtree_kv_bytes: int
    residency: Literal["materializing", "resident", "evicted"]
    materialized_from: PoolSource = Field(
        "prefill", description="how its own cells were last put in this replica's KV cache"
    )
    pinned: bool = Field(description="explicitly pinned, or auto-pinned while in use")
    pinned_explicit: bool
    orphaned_pin: bool = Field(description="pinned with no sessions and no children")
    created_ts: float
    last_access_ts: float
    depth: int
    path: str
    children: list[int]
    sessions: list[PoolSession]
    seq_id: int | None
    n_active: int = Field(0, description="attached sessions decoding with a measured rate")
    n_warming: int = Field(0, description="attached sessions decoding, rate not measured yet")
    active_tps_sum: float = Field(0.0, description="Σ tps_ewma of the n_active sessions")
    mean_active_tps: float = Field(
        0.0, description="active_tps_sum / n_active (0 when none): combine replicas by the sums"
    )
    admission: AdmissionPolicy | None = None
    capacity: CapacitySummary | None = Field(
        None, description="admission verdict for one more session (no expected_tokens)"
    )
    kept_until: float | None = Field(
        None,
        description="a kept prefix (unnamed: the prefix up to a tenant's cache_control "
        "breakpoint, listed only to that tenant and the admin): released at this time "
        "(epoch seconds) unless a request extends it; None for a declared pool",
    )


class PoolList(BaseModel):
    """``GET /polykv/pools``. Σ own_kv_bytes + Σ sessions' marginal == kv_bytes_used."""

    boot_id: str
    pools: list[PoolStatus]
    tree_depth: int
    seq_ids_used: int
    seq_ids_max: int
    kv_cells_used: int
    kv_cells_total: int
    kv_bytes_per_token: int
    kv_bytes_used: int = Field(
        description="kv_cells_used x kv_bytes_per_token, plus recurrent_state_bytes for every "
        "pool and session that computed tokens of its own"
    )
    recurrent_state_bytes: int = Field(
        0, description="a recurrent or hybrid model's state per sequence (0: none)"
    )
    unpooled_sessions: list[PoolSession] = Field(
        default_factory=list, description="sessions holding KV outside any pool"
    )
    implicit_shared_cells: int = Field(
        0,
        description="cells two or more sessions share without a pool (automatic prefix "
        "sharing); each is counted once, owned by the first session holding it",
    )
    kv_cells_measured: int | None = Field(
        None, description="llama.cpp's own used-cell count (engine started with --polykv-kv-debug)"
    )
    snapshots: SnapshotStoreStatus | None = Field(
        None, description="the KV snapshot store (None: --polykv-snapshot-dir not set)"
    )
    sessions_active: int = Field(0, description="sessions processing a turn (autoscaling)")
    sessions_refused: int = Field(
        0, description="distinct sessions refused in the last 60 s (gate 429 or a full queue)"
    )
    sessions_headroom: int = Field(0, description="more sessions free slots and KV would take")
    floor_pressure: float = Field(
        0.0, description="max over floored pools of floor / mean_active_tps on this replica"
    )
    n_active: int = Field(0, description="sessions decoding with a measured rate, engine-wide")
    n_warming: int = Field(0, description="sessions decoding, rate not measured yet")
    active_tps_sum: float = Field(0.0, description="Σ tps_ewma of the n_active sessions")
    mean_active_tps: float = Field(0.0, description="active_tps_sum / n_active (0 when none)")


class PoolDetail(PoolStatus):
    """``GET /polykv/pools/{id}``: the pool, its subtree, and the replica's boot id."""

    descendants: list[PoolStatus]
    boot_id: str


class PoolReleased(BaseModel):
    """``DELETE /polykv/pools/{id}``."""

    released: int = Field(description="the id the pool had on this replica")
    boot_id: str


class PoolRestore(BaseModel):
    """``PoolCreated.restore``: how a pool just created got its cells."""

    source: PoolSource
    refused: SnapshotRefusal | None = Field(
        None, description="a snapshot was found and not used (the pool was prefilled): why"
    )
    message: str | None = Field(None, description="the refusal, for people")
    snapshot_bytes: int = Field(0, description="bytes of the snapshot restored")
    seconds: float = Field(description="from the request's prefix ready to the pool resident")


class SnapshotStoreStatus(BaseModel):
    """``PoolList.snapshots``: this replica's KV snapshot store."""

    used_bytes: int
    max_bytes: int
    files: int
    bytes_written: int = Field(description="since boot")
    bytes_read: int = Field(description="since boot, from the store and from peers")
    refusals: int = Field(description="snapshots refused since boot (any reason)")


class PoolCreated(BaseModel):
    created: bool = Field(description="false when an existing pool of that name was returned")
    dry_run: bool = False
    restore: PoolRestore | None = Field(None, description="for a pool created by this call")
    pool: PoolStatus | None = None
    pool_id: int | None = None
    prefix_len: int
    branch_pos: int
    prefix_hash: str
    boot_id: str


# --------------------------------------------------------------------------- admission


class AdmissionPolicy(_Control):
    """``POST /polykv/pools/{id}/admission``: a per-pool floor on the mean experienced decode
    tps of its active sessions, checked when a NEW session attaches. Immutable once parsed."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    target_tps_per_session: float = Field(gt=0, description="the floor for mean experienced tps")
    mode: Literal["advisory", "enforced"] = "advisory"
    on_saturation: Literal["reject", "warn", "queue"] = "reject"
    guarantee_min_sessions: int = Field(1, ge=0, description="always admit up to this many")
    settle_tokens: int = Field(48, ge=1, description="tokens the last admit decodes to settle")
    settle_max_ms: int = Field(5000, ge=1, le=600_000)
    queue_max_ms: int = Field(30_000, ge=1, le=600_000, description="longest a queued attach waits")


class Capacity(BaseModel):
    """The admission verdict for one more session in a pool: may it join now without pushing
    the mean experienced decode tps of active sessions under the floor?"""

    can_admit: bool
    reason: str
    reason_code: AdmissionReason = "ok"
    projected_mean_tps_if_admitted: float | None
    projected_mean_tps_model: float | None
    projected_mean_tps_measured: float | None
    projected_idle_estimate: bool
    drop_per_admit_ewma: float | None
    headroom_sessions: int
    kv_headroom_pct: float
    settling: bool
    settle_remaining_ms: float
    n_warming: int
    n_active: int
    mean_active_tps: float
    n_pool_sessions: int
    guaranteed: bool
    known_session: bool
    compaction_pressure: float
    prefill_pending_tokens: int = Field(
        0, description="prompt tokens the engine has promised to compute (queued or running)"
    )
    projected_prefill_tps: float | None = Field(
        None,
        description="the decode rate a session gets while those prompts are computed beside "
        "the sessions decoding (null: nothing promised, or not measured yet)",
    )


class CapacityReport(Capacity):
    """``GET /polykv/pools/{id}/capacity[?expected_tokens=N&session_id=S]``."""

    pool_id: int
    policy: AdmissionPolicy | None
