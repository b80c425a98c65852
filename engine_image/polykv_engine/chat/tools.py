"""Tool calling in the model's own format (pure, apart from grammar text).

A chat template either knows tools (it renders ``tools`` and expects the model to answer
in its family's call syntax) or does not. The family is read off the template:

* ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
* ``llama3`` (Llama 3.1-3.3): ``{"name": ..., "parameters": {...}}``, maybe after <|python_tag|>
* ``mistral`` (Mistral, Nemo): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``
* ``generic`` (anything else): the tools and a JSON reply format go into the system message,
  and a grammar makes every reply ``{"tool_calls": [...]}`` or ``{"response": "..."}``, so
  even a small model answers in valid JSON.

``plan`` turns tools + ``tool_choice`` into a grammar (lazy for ``auto``: free text until the
model starts a call, constrained from there; strict for ``required`` or a named function) and
``ToolCallParser`` turns the output back into content and OpenAI ``tool_calls``, whole or as
streamed deltas whose concatenation equals the whole.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from polykv_engine.chat.partial_json import Node, NotJson, scan, skip_ws
from polykv_engine.llama.grammar import Grammar, GrammarError, from_schema
from polykv_engine.llama.schema_bounds import SchemaBoundError, check_schema

ToolFormat = Literal["hermes", "llama3", "mistral", "generic"]
Choice = Literal["none", "auto", "required"]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"


class ToolError(ValueError):
    """A request's tools or tool_choice cannot be honoured; the message names the field."""


def detect_format(template: str) -> ToolFormat:
    """The call syntax a chat template teaches its model (``generic`` when it has none)."""
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_TAG in template:
        return "mistral"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3"
    return "generic"


def preserved_markers(fmt: ToolFormat) -> tuple[str, ...]:
    """Marker strings that may be special tokens: rendered in the output, not dropped."""
    return {
        "hermes": (HERMES_OPEN, HERMES_CLOSE),
        "llama3": (PYTHON_TAG,),
        "mistral": (MISTRAL_TAG,),
        "generic": (),
    }[fmt]


# ---------------------------------------------------------------------------- requests


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The ``function`` object of an OpenAI tool (400 when it is not one)."""
    fn = tool.get("function") if tool.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolError('tools: each tool must be {"type": "function", "function": {"name": ...}}')
    params = fn.get("parameters", {"type": "object"})
    if not isinstance(params, dict):
        raise ToolError(f"tools: parameters of {fn['name']!r} must be a JSON schema object")
    return fn


def resolve_choice(
    tools: Sequence[dict[str, Any]] | None, tool_choice: Any
) -> tuple[Choice, list[dict[str, Any]]]:
    """(mode, the functions the model may call) from OpenAI's ``tool_choice``."""
    functions = [function_of(t) for t in tools or []]
    if tool_choice is None:
        return ("auto" if functions else "none"), functions
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not functions:
            raise ToolError(f"tool_choice {tool_choice!r} needs tools")
        return tool_choice, functions
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            known = ", ".join(f["name"] for f in functions) or "none"
            raise ToolError(f"tool_choice names function {name!r}, not among the tools ({known})")
        return "required", chosen
    raise ToolError(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}'
    )


def generic_system_text(functions: Sequence[dict[str, Any]]) -> str:
    """What a template without tool support gets in its system message. Canonical (sorted
    keys) so a pool created from the same messages and tools shares every token."""
    listing = "\n".join(json.dumps(f, sort_keys=True, ensure_ascii=False) for f in functions)
    return (
        "You can call these functions:\n"
        f"{listing}\n"
        'Reply with JSON only: {"tool_calls": [{"name": <function>, "arguments": {...}}]} '
        'to call functions, or {"response": <text>} to answer the user. A function\'s '
        'result comes back as {"tool_response": ...}: use it to answer the user.'
    )


def render_history(
    fmt: ToolFormat, messages: list[dict[str, Any]], functions: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Messages as the template expects them. Tool-aware templates get assistant
    ``tool_calls`` with ``arguments`` as objects (they serialize them themselves); the generic
    format gets calls and results as the JSON it asks the model to write."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if fmt == "generic":
            if calls:
                m["content"] = json.dumps(
                    {"tool_calls": [_generic_call(c) for c in calls]}, ensure_ascii=False
                )
                m.pop("tool_calls")
            elif m.get("role") == "tool":
                m = {
                    "role": "user",
                    "content": json.dumps(
                        {"tool_response": {"id": m.get("tool_call_id"), "content": m["content"]}},
                        ensure_ascii=False,
                    ),
                }
            elif m.get("role") == "assistant" and functions:
                m["content"] = json.dumps({"response": m.get("content") or ""}, ensure_ascii=False)
        elif calls:
            m["tool_calls"] = [_object_arguments(c) for c in calls]
        out.append(m)
    if fmt == "generic" and functions:
        text = generic_system_text(functions)
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _arguments(call: dict[str, Any]) -> Any:
    """A past call's arguments as an object; text that is not JSON stays the model's own
    string. OpenAI's contract says models do not always write valid JSON, and a client
    replaying a call cut short by max_tokens must not lose the conversation to a 400."""
    args = (call.get("function") or {}).get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except ValueError:
            return args
    return args


def _object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    fn["arguments"] = _arguments(call)
    return {**call, "function": fn, "name": fn.get("name"), "arguments": fn["arguments"]}


def _generic_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"name": fn.get("name"), "arguments": _arguments(call), "id": call.get("id")}


# ---------------------------------------------------------------------------- grammars


@dataclass(frozen=True, slots=True)
class ToolPlan:
    fmt: ToolFormat
    mode: Choice
    functions: tuple[dict[str, Any], ...]
    grammar: Grammar | None
    parse: bool  # turn the output into content + tool_calls

    @property
    def markers(self) -> tuple[str, ...]:
        return preserved_markers(self.fmt)


def _call_schema(fn: dict[str, Any], args_key: str) -> dict[str, Any]:
    params = fn.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: params},
        "required": ["name", args_key],
    }


def _calls_rule(functions: Sequence[dict[str, Any]], args_key: str) -> str:
    """GBNF with ``call`` (one call object of any listed function) and its helper rules."""
    schema = {"anyOf": [_call_schema(f, args_key) for f in functions]}
    return from_schema(schema).replace("root ::=", "call ::=", 1)


def plan(
    fmt: ToolFormat,
    tools: Sequence[dict[str, Any]] | None,
    tool_choice: Any,
    parallel: bool = True,
) -> ToolPlan | None:
    """How to sample and parse a chat request with tools; None when there are none."""
    mode, functions = resolve_choice(tools, tool_choice)
    if not functions:
        return None
    for fn in functions:  # each schema on its own, so a refusal names its function
        try:
            check_schema(fn.get("parameters") or {})
        except SchemaBoundError as exc:
            raise GrammarError(
                f"parameters of {fn['name']!r}{exc}", reason="schema_too_large"
            ) from exc
    fns = tuple(functions)
    if fmt == "generic":
        return ToolPlan(fmt, mode, fns, Grammar(_generic_gbnf(fns, mode, parallel)), True)
    if mode == "none":
        return ToolPlan(fmt, mode, fns, None, False)
    many = '(ws "," ws call)*' if parallel else ""
    if fmt == "hermes":
        one = f'"{HERMES_OPEN}" ws call ws "{HERMES_CLOSE}"'
        body = f"{one} (ws {one})*" if parallel else one
        triggers = (f"({HERMES_OPEN})",)
        root = f"root ::= {body}"
    elif fmt == "mistral":
        root = f'root ::= "{MISTRAL_TAG}" ws "[" ws call {many} ws "]"'
        triggers = (r"(\[TOOL_CALLS\])",)
    else:  # llama3: bare call objects, separated by ";" when several
        sep = '(ws ";" ws call)*' if parallel else ""
        root = f'root ::= ("<|python_tag|>" ws)? call {sep}'
        triggers = (r"^\s*(<\|python_tag\|>|\{\s*\"name\")",)
    args_key = "parameters" if fmt == "llama3" else "arguments"
    gbnf = f"{root}\nws ::= [ \\t\\n]*\n{_calls_rule(fns, args_key)}"
    return ToolPlan(fmt, mode, fns, Grammar(gbnf, triggers if mode == "auto" else ()), True)


def _generic_gbnf(functions: Sequence[dict[str, Any]], mode: Choice, parallel: bool) -> str:
    call = {"anyOf": [_call_schema(f, "arguments") for f in functions]}
    calls: dict[str, Any] = {
        "type": "object",
        "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
        "required": ["tool_calls"],
    }
    if not parallel:
        calls["properties"]["tool_calls"]["maxItems"] = 1
    response = {
        "type": "object",
        "properties": {"response": {"type": "string"}},
        "required": ["response"],
    }
    schema = {"auto": {"anyOf": [calls, response]}, "required": calls, "none": response}[mode]
    return from_schema(schema)


# ---------------------------------------------------------------------------- parsing


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""  # the model's own JSON text of the arguments

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    call: ToolCall


@dataclass(frozen=True, slots=True)
class ArgsDelta:
    index: int
    text: str


Delta = ContentDelta | CallStart | ArgsDelta


@dataclass
class _Seen:
    """What the output says so far: content that cannot change, and calls."""

    content: str = ""
    calls: list[tuple[str | None, str, str | None]] = field(default_factory=list)
    # (name once complete, arguments text so far, id the model gave)


def _hold_prefix(text: str, marker: str) -> str:
    """``text`` minus a tail that could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text


def _call_from(
    node: Node, doc: str, args_keys: tuple[str, ...]
) -> tuple[str | None, str, str | None]:
    name = node.get("name")
    args = next((a for a in (node.get(k) for k in args_keys) if a is not None), None)
    ident = node.get("id")
    return (
        name.text if name is not None and name.complete else None,
        args.source(doc) if args is not None else "",
        ident.text if ident is not None and ident.complete else None,
    )


def _hermes(doc: str, final: bool) -> _Seen:
    seen = _Seen()
    pos = 0
    while True:
        i = doc.find(HERMES_OPEN, pos)
        if i < 0:
            tail = doc[pos:]
            seen.content += tail if final else _hold_prefix(tail, HERMES_OPEN)
            return seen
        seen.content += doc[pos:i]
        try:
            node = scan(doc, i + len(HERMES_OPEN))
        except NotJson:
            if skip_ws(doc, i + len(HERMES_OPEN)) >= len(doc) and not final:
                return seen  # the call's JSON has not started yet
            seen.content += doc[i:]
            return seen
        seen.calls.append(_call_from(node, doc, ("arguments", "parameters")))
        if node.end is None:
            return seen
        close = skip_ws(doc, node.end)
        if doc.startswith(HERMES_CLOSE, close):
            pos = close + len(HERMES_CLOSE)
        elif not final and HERMES_CLOSE.startswith(doc[close:]):
            return seen  # the closing tag is still arriving
        else:
            pos = node.end


def _llama3(doc: str, final: bool) -> _Seen:
    start = skip_ws(doc, 0)
    tagged = doc.startswith(PYTHON_TAG, start)
    if tagged:
        start = skip_ws(doc, start + len(PYTHON_TAG))
    elif not final and PYTHON_TAG.startswith(doc[start:]) and start < len(doc):
        return _Seen()  # maybe the tag, maybe not: wait
    if start >= len(doc):
        return _Seen() if tagged or not final else _Seen(content=doc)
    if doc[start] != "{":
        return _Seen(content=doc)
    seen = _Seen()
    pos = start
    while pos < len(doc):
        try:
            node = scan(doc, pos)
        except NotJson:
            return _Seen(content=doc) if not seen.calls else seen
        if node.kind != "object" or (node.items and node.items[0][0] not in ("name", "type")):
            return _Seen(content=doc)
        if not node.items:  # "{" alone: undecided
            return _Seen(content=doc) if final else seen
        seen.calls.append(_call_from(node, doc, ("parameters", "arguments")))
        if node.end is None:
            return seen
        pos = skip_ws(doc, node.end)
        if pos < len(doc) and doc[pos] == ";":
            pos = skip_ws(doc, pos + 1)
    return seen


def _mistral(doc: str, final: bool) -> _Seen:
    i = doc.find(MISTRAL_TAG)
    if i < 0:
        return _Seen(content=doc if final else _hold_prefix(doc, MISTRAL_TAG))
    seen = _Seen(content=doc[:i])
    try:
        node = scan(doc, i + len(MISTRAL_TAG))
    except NotJson:
        return seen if not final else _Seen(content=doc)
    if node.kind != "array":
        return _Seen(content=doc) if final else seen
    for _, item in node.items:
        if item.kind == "object":
            seen.calls.append(_call_from(item, doc, ("arguments", "parameters")))
    return seen


def _generic(doc: str, final: bool) -> _Seen:
    try:
        root = scan(doc)
    except NotJson:
        return _Seen(content=doc if final or doc.strip() else "")
    if root.kind != "object":
        return _Seen(content=doc) if final else _Seen()
    seen = _Seen()
    response = root.get("response")
    if response is not None and response.kind == "string":
        seen.content = response.text
    calls = root.get("tool_calls")
    if calls is not None and calls.kind == "array":
        for _, item in calls.items:
            if item.kind == "object":
                seen.calls.append(_call_from(item, doc, ("arguments", "parameters")))
    return seen


_PARSERS: dict[ToolFormat, Callable[[str, bool], _Seen]] = {
    "hermes": _hermes,
    "llama3": _llama3,
    "mistral": _mistral,
    "generic": _generic,
}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """Output text in, content and tool calls out: ``feed`` returns what became certain
    (streamed deltas), ``finish`` the rest; ``content`` and ``calls`` are the whole."""

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self._parse = _PARSERS[fmt]
        self._new_id = new_id
        self.text = ""
        self.content = ""
        self.calls: list[ToolCall] = []

    def feed(self, piece: str) -> list[Delta]:
        self.text += piece
        return self._advance(self._parse(self.text, False), final=False)

    def finish(self) -> list[Delta]:
        return self._advance(self._parse(self.text, True), final=True)

    def _advance(self, seen: _Seen, final: bool) -> list[Delta]:
        out: list[Delta] = []
        content = seen.content
        if not final or seen.calls:
            content = content.rstrip()  # trailing blanks before a call are not content
        if content.startswith(self.content) and len(content) > len(self.content):
            out.append(ContentDelta(content[len(self.content) :]))
            self.content = content
        for i, (name, args, ident) in enumerate(seen.calls):
            if name is None:
                break  # later calls wait until this one's name is known
            if i >= len(self.calls):
                call = ToolCall(i, ident or self._new_id(), name)
                self.calls.append(call)
                out.append(CallStart(call))
            call = self.calls[i]
            if args.startswith(call.arguments) and len(args) > len(call.arguments):
                out.append(ArgsDelta(i, args[len(call.arguments) :]))
                call.arguments = args
        return out
