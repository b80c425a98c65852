"""The Anthropic Messages API as this engine serves it (``POST /v1/messages`` and
``/v1/messages/count_tokens``): request and response bodies.

Field names and shapes are Anthropic's, so the official SDKs and Claude Code parse them
unchanged. Requests accept unknown fields (reported in ``X-PolyKV-Ignored-Fields``) and the
PolyKV extensions every completion route has (``pool_id``, ``session_id``, ``overcommit``,
``top_k``...). Content blocks other than ``text``, ``tool_use`` and ``tool_result`` are
refused by name: this engine serves text models.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from polykv_api.limits import (
    INT32_MAX,
    MAX_BLOCKS,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TOOLS,
)
from polykv_api.models import SamplingFields, supported_types

BLOCK_TYPES = ("text", "tool_use", "tool_result")
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class CacheControl(_Block):
    """A breakpoint: the prefix up to here is kept for ``ttl`` (5 minutes by default), so
    the tenant's later requests, in any session, read it from KV. A request keeps one
    prefix: up to its last breakpoint, for the longest ``ttl`` its breakpoints ask."""

    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


def _known_blocks(value: Any, allowed: tuple[str, ...] = BLOCK_TYPES) -> Any:
    return supported_types("content block", value, allowed, ": this engine serves text models")


class Message(_Block):
    """A turn. Claude Code also sends ``system`` turns inside ``messages`` (a reminder after
    the user's words); they are read as the user's."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock] = Field(max_length=MAX_BLOCKS)

    @field_validator("content", mode="before")
    @classmethod
    def _supported_blocks(cls, value: Any) -> Any:
        return _known_blocks(value)


class Tool(_Block):
    """A client tool: the model may call it with input valid against ``input_schema``.
    Anthropic's server tools (a ``type`` such as ``web_search_20250305``) are refused."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "custom":
            raise ValueError(
                f"tool type {value!r} is a server tool, which this engine does not run; "
                "give client tools (name, description, input_schema)"
            )
        return value


class ToolChoice(_Block):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(_Block):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Block):
    """``format`` is enforced with a grammar; ``effort`` is read and ignored."""

    effort: str | None = None
    format: OutputFormat | None = None


class MessagesRequest(SamplingFields):
    """``POST /v1/messages``. ``thinking``, ``context_management``, ``metadata``,
    ``service_tier`` and ``speed`` are accepted and not used (the reply never holds
    thinking blocks); they are named in ``X-PolyKV-Ignored-Fields``."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOPS
    )
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None

    UNUSED: ClassVar[tuple[str, ...]] = (
        "thinking",
        "context_management",
        "metadata",
        "service_tier",
        "speed",
    )

    @model_validator(mode="after")
    def _stops_bounded(self) -> MessagesRequest:
        if len(self.stop_sequences) + len(self.stop) > MAX_STOPS:
            raise ValueError(f"stop_sequences and stop: at most {MAX_STOPS} in all")
        return self

    @field_validator("system", mode="before")
    @classmethod
    def _system_text_only(cls, value: Any) -> Any:
        return _known_blocks(value, ("text",))

    def ignored_fields(self) -> list[str]:
        used = [name for name in self.UNUSED if getattr(self, name) is not None]
        effort = self.output_config is not None and self.output_config.effort is not None
        return sorted([*super().ignored_fields(), *used, *(["output_config.effort"] * effort)])

    def cache_ttl(self) -> Literal["5m", "1h"] | None:
        """The longest TTL the request's breakpoints ask for; None without a breakpoint."""
        blocks: list[Any] = [self, *(self.tools or [])]
        if isinstance(self.system, list):
            blocks += self.system
        for m in self.messages:
            if isinstance(m.content, list):
                blocks.extend(m.content)
        asked = [b.cache_control.ttl or "5m" for b in blocks if b.cache_control is not None]
        if not asked:
            return None
        return "1h" if "1h" in asked else "5m"


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: the same body without ``max_tokens``."""

    max_tokens: int = Field(1, ge=1, le=INT32_MAX)


# --------------------------------------------------------------------------- responses


class Usage(BaseModel):
    """Anthropic's split: ``cache_read_input_tokens`` came from KV (a kept prefix, a pool,
    the session's own cache or another of the tenant's sequences),
    ``cache_creation_input_tokens`` were computed now into the prefix kept for the
    request's breakpoint, ``input_tokens`` the rest (past the breakpoint, or not kept).
    The three add up to the prompt's length."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class OutTextBlock(BaseModel):
    type: Literal["text"]
    text: str


class OutToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(BaseModel):
    """``POST /v1/messages`` (not streamed)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[OutTextBlock | OutToolUseBlock]
    stop_reason: StopReason
    stop_sequence: str | None
    usage: Usage


class TokenCount(BaseModel):
    """``POST /v1/messages/count_tokens``."""

    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="invalid_request_error, rate_limit_error, overloaded_error...")
    message: str
    reason: str = Field(description="PolyKV's stable code (polykv_api.models.Reason)")


class AnthropicError(BaseModel):
    """The error body of the ``/v1/messages`` routes, in Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail
