"""``PolyKVChatModel``: LangChain's ``ChatOpenAI`` (so a ``BaseChatModel``) made to speak
PolyKV.

What it adds to stock ``ChatOpenAI``:

* **Session per thread.** Every request carries ``x-session-id``, keyed on the graph's
  ``thread_id`` (``configurable``), so each turn of a conversation is a continuation of one
  engine session: its KV is reused, and an enforced pool never refuses it. A scope (an agent's
  name) gives each agent of a multi-agent thread its own session: ``<thread>/<scope>``.
  Outside a graph the model keeps one session of its own.
* **Pool attach.** ``pool_id`` (id or name, per model or per call) goes into the body.
* **Signals.** The engine's headers become ``response_metadata["polykv"]`` (pool id, cached
  prefix tokens, session tps, compaction pressure, context headroom, backpressure), on the
  message of ``invoke`` and on the first chunk of a stream; reuse is in
  ``usage_metadata["input_token_details"]["cache_read"]``. ``polykv_signals(msg)`` reads it.
* **Refusals typed.** A 429 from the admission gate raises ``PoolSaturated`` (with
  ``retry_after``) at once instead of being retried by the OpenAI SDK; other PolyKV refusals
  raise the ``polykv_client`` exception of their reason code.
* **Token counts from the engine.** ``get_num_tokens_from_messages`` renders and tokenizes on
  the engine (the model's own template and vocabulary), not with tiktoken.

Per call (``invoke(..., pool_id=, session_id=, session_scope=, overcommit=)``) or bound
(``model.bind(pool_id="workers", session_scope="w1")``), these override the model's fields.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import openai
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.utils import convert_to_openai_messages
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig, ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from pydantic import Field, PrivateAttr, SecretStr, model_validator

from polykv_client import SESSION_ID, AsyncPolyKVClient, PolyKVClient, Signals
from polykv_client.errors import error_from_response

METADATA_KEY = "polykv"
"""The ``response_metadata`` key holding the engine's signals (a ``Signals`` dump)."""

SESSION_CONFIG_KEY = "polykv_session_id"
"""A ``configurable`` key that names the session outright (instead of the thread)."""

_CALL_KEYS = ("pool_id", "session_id", "session_scope", "overcommit")


def session_key(
    config: RunnableConfig | None = None, scope: str | None = None, default: str | None = None
) -> str | None:
    """The engine session of a call: ``configurable["polykv_session_id"]`` if set, else the
    ``thread_id`` (``<thread>/<scope>`` with a scope), else ``default`` (None: no session).
    ``config`` defaults to the running LangGraph node's."""
    conf = ensure_config(config).get("configurable", {})
    named = conf.get(SESSION_CONFIG_KEY)
    if named:
        return str(named)
    base = conf.get("thread_id") or default
    if not base:
        return None
    return f"{base}/{scope}" if scope else str(base)


def polykv_signals(message: BaseMessage) -> Signals | None:
    """The engine's signals on a model's reply (None when it carried none)."""
    raw = message.response_metadata.get(METADATA_KEY)
    return Signals.model_validate(raw) if isinstance(raw, Mapping) else None


def _gate_refusal_is_final(response: Any) -> None:
    """A 429 from the admission gate is the graph's to handle (wait, interrupt, route
    elsewhere): tell the OpenAI SDK not to retry it behind the caller's back."""
    if response.status_code == 429:
        response.headers["x-should-retry"] = "false"


async def _agate_refusal_is_final(response: Any) -> None:
    _gate_refusal_is_final(response)


class PolyKVChatModel(ChatOpenAI):
    """A chat model on a PolyKV engine (``base_url``: the engine, with or without ``/v1``).

    ``pool_id`` attaches every turn to a pool; ``session_scope`` names this agent within a
    thread. The session key is, in order: a ``session_id`` given to the call, the
    ``configurable`` ``polykv_session_id``, the ``thread_id`` (with the scope), else this
    model's own id."""

    model_name: str = Field(default="polykv", alias="model")
    openai_api_key: SecretStr | None = Field(alias="api_key", default=SecretStr("none"))
    include_response_headers: bool = True
    stream_usage: bool | None = True
    use_responses_api: bool | None = False

    pool_id: int | str | None = None
    """Attach every turn to this pool (its id or name); a call's ``pool_id`` overrides it."""
    session_scope: str | None = None
    """Appended to the thread id: one engine session per agent of a multi-agent thread."""
    default_session_id: str = Field(default_factory=lambda: f"polykv-{uuid.uuid4().hex[:12]}")
    """The session used outside any thread (one per model object unless set)."""
    admin_key: SecretStr | None = Field(default=None, exclude=True)
    """For ``client``'s pool mutations (an agent usually has none: the operator holds it)."""

    _client: PolyKVClient | None = PrivateAttr(default=None)
    _aclient: AsyncPolyKVClient | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _polykv_defaults(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        values = dict(values)
        for key in ("base_url", "openai_api_base"):
            url = values.get(key)
            if isinstance(url, str) and not url.rstrip("/").endswith("/v1"):
                values[key] = url.rstrip("/") + "/v1"
        if values.get("http_client") is None:
            values["http_client"] = openai.DefaultHttpxClient(
                event_hooks={"response": [_gate_refusal_is_final]}
            )
        if values.get("http_async_client") is None:
            values["http_async_client"] = openai.DefaultAsyncHttpxClient(
                event_hooks={"response": [_agate_refusal_is_final]}
            )
        return values

    @property
    def _llm_type(self) -> str:
        return "polykv-chat"

    # ------------------------------------------------------------------ pool API

    @property
    def client_url(self) -> str:
        return str(self.openai_api_base or "").removesuffix("/v1")

    def _keys(self) -> tuple[str | None, str | None]:
        api = self.openai_api_key.get_secret_value() if self.openai_api_key else None
        admin = self.admin_key.get_secret_value() if self.admin_key else None
        return (None if api == "none" else api), admin

    @property
    def polykv(self) -> PolyKVClient:
        """A pool API client for the same engine (and keys)."""
        if self._client is None:
            api, admin = self._keys()
            self._client = PolyKVClient(self.client_url, api_key=api, admin_key=admin)
        return self._client

    @property
    def apolykv(self) -> AsyncPolyKVClient:
        """The async pool API client for the same engine (and keys)."""
        if self._aclient is None:
            api, admin = self._keys()
            self._aclient = AsyncPolyKVClient(self.client_url, api_key=api, admin_key=admin)
        return self._aclient

    def get_token_ids(self, text: str) -> list[int]:
        return self.polykv.tokenize(text)

    def get_num_tokens_from_messages(
        self,
        messages: Sequence[BaseMessage],
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool] | None = None,
        *,
        allow_fetching_images: bool = False,
    ) -> int:
        """Prompt tokens these messages (and tools) take, as the engine renders them."""
        rendered = self.polykv.apply_template(
            _as_dicts(messages), [convert_to_openai_tool(t) for t in tools] if tools else None
        )
        return len(self.polykv.tokenize(rendered, add_special=True))

    # ------------------------------------------------------------------ session key

    def session_for(self, config: RunnableConfig | None = None, scope: str | None = None) -> str:
        """The session key a call with ``config`` (default: the running node's) uses."""
        scope = scope if scope is not None else self.session_scope
        return session_key(config, scope, self.default_session_id) or self.default_session_id

    def _keyed(self, config: RunnableConfig | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        if kwargs.get("session_id"):
            return kwargs
        return {**kwargs, "session_id": self.session_for(config, kwargs.get("session_scope"))}

    def invoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        return super().invoke(input, config, stop=stop, **self._keyed(config, kwargs))

    async def ainvoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        return await super().ainvoke(input, config, stop=stop, **self._keyed(config, kwargs))

    def stream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        yield from super().stream(input, config, stop=stop, **self._keyed(config, kwargs))

    async def astream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        async for chunk in super().astream(input, config, stop=stop, **self._keyed(config, kwargs)):
            yield chunk

    # ------------------------------------------------------------------ requests

    def _polykv_request(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Turn the PolyKV call keys into the OpenAI SDK's extra headers and body."""
        ours = {k: kwargs.pop(k) for k in _CALL_KEYS if k in kwargs}
        session = ours.get("session_id") or self.session_for(None, ours.get("session_scope"))
        kwargs["extra_headers"] = {**(kwargs.get("extra_headers") or {}), SESSION_ID: session}
        body = {**(self.extra_body or {}), **(kwargs.get("extra_body") or {})}
        pool = ours.get("pool_id", self.pool_id)
        if pool is not None:
            body["pool_id"] = pool
        if ours.get("overcommit"):
            body["overcommit"] = True
        if body:
            kwargs["extra_body"] = body
        return kwargs

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with _refusals_typed():
            result = super()._generate(messages, stop, run_manager, **self._polykv_request(kwargs))
        for gen in result.generations:
            gen.generation_info = _with_signals(gen.generation_info)
        return result

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        with _refusals_typed():
            result = await super()._agenerate(
                messages, stop, run_manager, **self._polykv_request(kwargs)
            )
        for gen in result.generations:
            gen.generation_info = _with_signals(gen.generation_info)
        return result

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        with _refusals_typed():
            for chunk in super()._stream(
                messages, stop, run_manager, **self._polykv_request(kwargs)
            ):
                chunk.generation_info = _with_signals(chunk.generation_info)
                yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        with _refusals_typed():
            async for chunk in super()._astream(
                messages, stop, run_manager, **self._polykv_request(kwargs)
            ):
                chunk.generation_info = _with_signals(chunk.generation_info)
                yield chunk


def _with_signals(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """Add the typed signals next to the raw headers ChatOpenAI keeps (first chunk only)."""
    headers = (info or {}).get("headers")
    if not isinstance(headers, Mapping):
        return info
    return {**(info or {}), METADATA_KEY: Signals.from_headers(headers).model_dump()}


@contextlib.contextmanager
def _refusals_typed() -> Iterator[None]:
    """An error answer carrying a PolyKV reason code becomes its typed exception."""
    try:
        yield
    except openai.APIStatusError as exc:
        body = _json(exc.response)
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict) or "reason" not in err:
            raise
        raise error_from_response(exc.status_code, exc.response.headers, body) from exc


def _json(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _as_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    converted = convert_to_openai_messages(list(messages))
    return [dict(m) for m in (converted if isinstance(converted, list) else [converted])]
