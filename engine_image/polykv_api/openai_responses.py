"""OpenAI's Responses API as this engine serves it (``POST /v1/responses``), for
function-calling agents (Codex, the ``openai`` SDK's ``responses`` calls, LangChain's
newer paths): request and response bodies.

Supported: ``input`` as text or items (messages, ``function_call``,
``function_call_output``), ``instructions``, function tools (also grouped in a
``namespace``), ``tool_choice``, ``text.format`` (JSON schema, by grammar), streaming,
``previous_response_id`` and ``prompt_cache_key``. Refused by name: OpenAI's built-in tools
(``web_search``, ``file_search``, ...), input items and content parts other than the above
(images, files, ``reasoning`` items), ``background`` and ``conversation``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from polykv_api.limits import INT32_MAX, MAX_BLOCKS, MAX_TOOLS
from polykv_api.models import SamplingFields, supported_types

ITEM_TYPES = ("message", "function_call", "function_call_output")
PART_TYPES = ("input_text", "output_text")
TOOL_TYPES = ("function", "namespace")
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(_Item):
    type: Literal["input_text", "output_text"]
    text: str


def _parts(value: Any) -> Any:
    return supported_types("content part", value, PART_TYPES, ": this engine serves text models")


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart] = Field(max_length=MAX_BLOCKS)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return _parts(value)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    namespace: str | None = Field(None, pattern=FUNCTION_NAME_PATTERN)
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[TextPart] = Field(max_length=MAX_BLOCKS)

    @field_validator("output", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return _parts(value)

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output)


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")
]


class FunctionTool(_Item):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(_Item):
    """Function tools grouped under a name (Codex's ``multi_agent_v1``); a call names both
    (``namespace`` and ``name``)."""

    type: Literal["namespace"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    tools: list[FunctionTool] = Field(max_length=MAX_TOOLS)


Tool = Annotated[FunctionTool | NamespaceTool, Field(discriminator="type")]


class TextFormat(_Item):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Item):
    """``format`` is enforced by a grammar; ``verbosity`` is read and ignored."""

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(SamplingFields):
    """``POST /v1/responses``. ``reasoning``, ``include``, ``metadata``, ``client_metadata``,
    ``store``, ``truncation``, ``user``, ``safety_identifier``, ``service_tier`` and
    ``prompt_cache_retention`` are accepted and not used (named in
    ``X-PolyKV-Ignored-Fields``): the reply never holds reasoning items, and a response is
    kept (for ``previous_response_id``) as long as the engine keeps its session, whatever
    ``store`` says."""

    model: str | None = None
    input: str | list[InputItem] = Field(max_length=MAX_BLOCKS)
    instructions: str | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    text: TextConfig | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=256)
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None
    store: bool | None = None
    truncation: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None

    UNUSED: ClassVar[tuple[str, ...]] = (
        "reasoning", "include", "metadata", "client_metadata", "store", "truncation", "user",
        "safety_identifier", "service_tier", "prompt_cache_retention",
    )  # fmt: skip
    REFUSED: ClassVar[dict[str, str]] = {
        "background": "background responses are not supported: stream instead",
        "conversation": "conversations are not stored: continue with previous_response_id",
        "prompt": "stored prompt templates are not supported: send input and instructions",
    }

    @model_validator(mode="before")
    @classmethod
    def _refused_by_name(cls, body: Any) -> Any:
        if isinstance(body, dict):
            for name, why in cls.REFUSED.items():
                if body.get(name) not in (None, False):
                    raise ValueError(f"{name}: {why}")
        return body

    @field_validator("input", mode="before")
    @classmethod
    def _supported_items(cls, value: Any) -> Any:
        if isinstance(value, list):  # a message may leave out its type
            value = [
                {"type": "message", **v} if isinstance(v, dict) and "type" not in v else v
                for v in value
            ]
        return supported_types("input item", value, ITEM_TYPES, "")

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        return supported_types(
            "tool", value, TOOL_TYPES, ": built-in tools run on OpenAI's servers, not here "
            '(Codex: web_search = "disabled")',
        )  # fmt: skip

    def ignored_fields(self) -> list[str]:
        used = [name for name in self.UNUSED if getattr(self, name) is not None]
        verbosity = self.text is not None and self.text.verbosity is not None
        return sorted([*super().ignored_fields(), *used, *(["text.verbosity"] * verbosity)])


# --------------------------------------------------------------------------- responses


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from KV (pool or session)")
    cache_write_tokens: int = Field(description="prompt tokens computed and kept for reuse")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    status: Literal["completed", "incomplete"]
    call_id: str
    name: str
    namespace: str | None = None
    arguments: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """``POST /v1/responses`` (not streamed); streamed, it is the ``response`` of
    ``response.created`` and ``response.completed``."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    previous_response_id: str | None
    instructions: str | None
    tool_choice: Any
    tools: list[Any]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    error: None = None
