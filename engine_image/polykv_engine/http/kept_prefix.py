"""Kept prefixes from the routes' side (``pools.kept``): where in a prompt's tokens the
prefix to keep ends, and asking the engine to keep it for the request's tenant.

Where it ends is found without knowing the template: the request is rendered a second time
with ``chat.turns.PREFIX_MARK`` put where the prefix ends (after an Anthropic breakpoint's
content; before the newest user turn of a Responses request), the two renderings part
there, and the text before that point, tokenized, shares that many tokens with the prompt.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from polykv_api.models import ChatMessage
from polykv_engine.core import pool_ops
from polykv_engine.core.tasks import GenerateTask
from polykv_engine.http.app_context import AppContext, ctx_of
from polykv_engine.http.auth import identity_of
from polykv_engine.pools import kept
from polykv_engine.tokens import common_prefix_len


@dataclass(frozen=True, slots=True)
class KeptPart:
    """The prefix kept for a request, as its usage reports it."""

    length: int = 0  # its tokens (0: nothing kept)
    computed: int = 0  # of them, computed now for this request

    def held(self, task: GenerateTask) -> KeptPart:
        """Nothing was kept when the prefix went before the request ran (the engine then
        dropped the task's pool and computed the tokens)."""
        return self if task.pool_ref is not None else KeptPart()


def prefix_len(
    ctx: AppContext,
    rendered: str,
    prompt: list[int],
    marked: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
) -> int:
    """How many of ``prompt``'s tokens (``rendered``, tokenized) come before the mark in
    ``marked``; 0 when the renderings do not part (the template dropped the marked text).
    Off the event loop: it renders and tokenizes."""
    text = ctx.render_messages(marked, tools, True)
    end = common_prefix_len(rendered, text)
    if end == len(rendered):
        return 0
    head = ctx.rt.tokenize(rendered[:end], add_special=True, parse_special=True)
    return common_prefix_len(head, prompt)


async def keep(request: web.Request, task: GenerateTask, n: int, ttl: str | None) -> KeptPart:
    """Keep the first ``n`` tokens of the task's prompt for its tenant (0: nothing) and
    attach the task to the kept prefix."""
    ctx = ctx_of(request)
    settings = ctx.settings
    if n < kept.KEEP_MIN_TOKENS or settings.kept_prefixes <= 0:
        return KeptPart()
    ttl_s = kept.ttl_s(ttl, settings.kept_ttl_max_s)
    ask = kept.KeepAsk(identity_of(request).tenant, task.prompt[:n], ttl_s)
    budget = settings.kept_prefixes
    held = await asyncio.wrap_future(
        ctx.engine.call(lambda e: pool_ops.keep_prefix(e, ask, budget))
    )
    if held is None:
        return KeptPart()
    task.pool_ref, task.pool_kept = held.pool_id, True
    return KeptPart(n, held.computed)


def keeps(ctx: AppContext, asked: bool, pool_named: bool) -> bool:
    """Whether a request that ``asked`` for its prefix to be kept gets it (not when it
    names a pool itself, nor with keeping off)."""
    return asked and not pool_named and ctx.settings.kept_prefixes > 0
