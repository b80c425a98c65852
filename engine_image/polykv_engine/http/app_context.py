"""What every HTTP handler needs: the engine, the server settings, and prompt helpers."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import Histogram

from polykv_api.agent_headers import SessionHeaders
from polykv_api.models import ChatCompletionRequest, ChatMessage, PromptPart
from polykv_engine.chat.template import CHATML_TEMPLATE, ChatRenderer, ChatTemplateError
from polykv_engine.chat.tools import (
    ToolError,
    ToolFormat,
    detect_format,
    function_of,
    render_history,
)
from polykv_engine.core.engine import Engine
from polykv_engine.http.admission_gate import AdmissionGate
from polykv_engine.http.errors import ApiError
from polykv_engine.http.metrics import PoolGauges
from polykv_engine.http.response_store import ResponseStore
from polykv_engine.llama.runtime import LlamaRuntime

log = logging.getLogger("polykv.chat")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()
    # (key, tenant id) for every inference key (http.tenants); a key missing here (tests
    # building settings by hand) is the admin's, or the open engine's implicit tenant.
    key_tenants: tuple[tuple[str, str], ...] = ()
    router_keys: tuple[str, ...] = ()  # X-PolyKV-Router-Key values that mark the router
    metrics: bool = False
    model_alias: str | None = None
    chat_template: str | None = None  # --chat-template-file: used instead of the model's
    tps_stream_interval_ms: int = 500
    stream_interval_s: float = 0.0  # a stream's tokens leave at most this often (first at once)
    shutdown_timeout_s: float = 20.0
    sse_ping_interval_s: float = 10.0  # keep-alive comments on an idle stream
    write_timeout_s: float = 600.0  # a client that reads nothing this long is dropped
    max_body_bytes: int | None = None  # None: derived from the context size (limits)
    n_predict: int = -1  # -n: the most tokens a request may generate (-1: no cap)
    kept_prefixes: int = 8  # per tenant, for cache_control breakpoints (pools.kept)
    kept_ttl_max_s: float = 3600.0
    # Which headers say who an agent is (polykv_api.agent_headers).
    session_headers: SessionHeaders = field(default_factory=SessionHeaders)


@dataclass(slots=True)
class AppContext:
    engine: Engine
    settings: ServerSettings
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    draining: bool = False
    in_flight: int = 0  # requests the engine owes an answer (the SIGTERM drain waits on it)
    gate: AdmissionGate | None = None
    pool_gauges: list[PoolGauges] = field(default_factory=list)
    restore_seconds: Histogram | None = None  # polykv_pool_restore_seconds{source}
    responses: ResponseStore = field(default_factory=ResponseStore)  # previous_response_id
    _renderer: ChatRenderer | None = None

    @contextlib.contextmanager
    def owed(self) -> Iterator[None]:
        """A request the engine owes an answer, counted until its last byte: the SIGTERM
        drain waits for the count, since the engine's snapshot lags a just-submitted task."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    @property
    def rt(self) -> LlamaRuntime:
        if self.engine.runtime is None or not self.engine.ready:
            raise ApiError(
                503, "Loading model", "unavailable_error", {"Retry-After": "1"}, reason="loading"
            )
        return self.engine.runtime

    def require_ready(self) -> None:
        """503 (with Retry-After) until the model is loaded."""
        _ = self.rt

    @property
    def model_name(self) -> str:
        if self.settings.model_alias:
            return self.settings.model_alias
        return str(self.engine.cfg.runtime.model_path.name)

    @property
    def renderer(self) -> ChatRenderer:
        if self._renderer is None:
            rt = self.rt
            self._renderer = ChatRenderer(
                self.settings.chat_template or rt.info.chat_template,
                rt.token_bytes(rt.info.bos, special=True).decode("utf-8", "replace"),
                rt.token_bytes(rt.info.eos, special=True).decode("utf-8", "replace"),
                rt.info.architecture,
            )
            if self.settings.chat_template is None and rt.info.chat_template is None:
                log.warning(
                    "the model file has no chat template: chat requests use %s",
                    "its family's turn format"
                    if self._renderer.source != CHATML_TEMPLATE
                    else "ChatML",
                )
        return self._renderer

    # ------------------------------------------------------------------ prompts → tokens

    def tokenize_prompt(self, prompt: str | list[PromptPart] | list[str]) -> list[int]:
        """llama-server rules: text gets BOS (if the model wants it) and special tokens parsed;
        a list mixes token ids and text pieces."""
        rt = self.rt
        if isinstance(prompt, str):
            tokens = rt.tokenize(prompt, add_special=True, parse_special=True)
        else:
            tokens = []
            for i, part in enumerate(prompt):
                if isinstance(part, int):
                    if not rt.valid_token(part):
                        raise ApiError(
                            400,
                            f"prompt[{i}]: token id {part} is outside the vocabulary "
                            f"(n_vocab={rt.info.n_vocab})",
                            reason="token_invalid",
                        )
                    tokens.append(part)
                else:
                    tokens.extend(rt.tokenize(part, add_special=(i == 0), parse_special=True))
        return self.check_prompt_fits(tokens)

    def token_piece(self, token: int) -> bytes:
        """A token's bytes as the output shows them (special tokens by their text)."""
        return self.rt.token_bytes(token, special=True)

    def special_tokens(self, markers: tuple[str, ...]) -> frozenset[int]:
        """Ids of the markers that are single (special) tokens in this vocabulary."""
        ids = set()
        for marker in markers:
            toks = self.rt.tokenize(marker, add_special=False, parse_special=True)
            if len(toks) == 1:
                ids.add(toks[0])
        return frozenset(ids)

    @property
    def tool_format(self) -> ToolFormat:
        """The tool-call syntax the model's chat template teaches it."""
        return detect_format(self.renderer.source)

    def render_chat(self, req: ChatCompletionRequest) -> str:
        return self.render_messages(req.messages, req.tools, True, req.chat_template_kwargs)

    def render_messages(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Chat messages through the model's template. Without the generation prompt this is
        the block a pool shares with later chat requests that start with the same messages."""
        rendered: list[dict[str, Any]] = []
        for m in messages:
            d = m.model_dump(exclude_none=True)
            d["content"] = m.text()
            rendered.append(d)
        fmt = self.tool_format
        try:
            functions = [function_of(t) for t in tools or []]
            rendered = render_history(fmt, rendered, functions)
        except ToolError as exc:
            raise ApiError(400, str(exc)) from exc
        # A template without tool support gets the tools in its system message instead.
        for_template = tools if fmt != "generic" else None
        try:
            text = self.renderer.render(rendered, for_template, add_generation_prompt, extra)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), reason="template_error") from exc
        bos = self.renderer.bos_token
        if self.rt.info.add_bos and bos and text.startswith(bos):
            text = text[len(bos) :]  # tokenization adds BOS itself; never twice
        return text

    def check_token_ids(self, tokens: list[int]) -> list[int]:
        """400 naming the ids that are not in the model's vocabulary."""
        rt = self.rt
        bad = [t for t in tokens if not rt.valid_token(t)]
        if bad:
            raise ApiError(
                400,
                f"tokens: ids outside the vocabulary (n_vocab={rt.info.n_vocab}): {bad[:8]}",
                reason="token_invalid",
            )
        return list(tokens)

    def check_prompt_fits(self, tokens: list[int], for_pool: bool = False) -> list[int]:
        """400 unless the tokens fit one slot's context (a pool prefix must too)."""
        if not tokens:
            raise ApiError(
                400, "the prompt is empty", reason="prefix_empty" if for_pool else "invalid_request"
            )
        n_ctx = self.engine.snapshot.n_ctx_slot
        if len(tokens) >= n_ctx:
            raise ApiError(
                400,
                f"the request exceeds the available context size: the prompt has "
                f"{len(tokens)} tokens and a slot's context is {n_ctx}",
                "exceed_context_size_error",
                extra={"n_prompt_tokens": len(tokens), "n_ctx": n_ctx},
                reason="prefix_too_long" if for_pool else "prompt_too_long",
            )
        return tokens


APP_KEY = web.AppKey("polykv", AppContext)


def ctx_of(request: web.Request) -> AppContext:
    return request.app[APP_KEY]
