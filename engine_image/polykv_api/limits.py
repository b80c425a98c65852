"""Every bound on what one request may make the engine do, in one place.

The wire models read the static numbers (pydantic field bounds); the engine checks the rest
before any llama.cpp call: JSON nesting while it parses a body, grammar size and nesting,
schema keywords, ``repeat_last_n`` against the slot's context. ``docs/engine.md``
("Bounds") lists each with its status and reason code.
"""

from __future__ import annotations

from dataclasses import dataclass

INT32_MAX = 2**31 - 1  # llama.cpp reads counts (n_predict, top_k, ...) into int32

MAX_STOPS = 16
MAX_STOP_CHARS = 4096  # a stop is text the model writes: longer ones cannot be meant
MAX_MESSAGES = 10_000  # every message costs template tokens: more never fit a context
MAX_TOOLS = 128  # OpenAI's own limit on functions per request
MAX_DRAFT = 64  # speculative tokens a step may verify per session: each takes a batch slot
MAX_BLOCKS = 10_000  # content blocks (or input items) in one message: like messages, each
# costs template tokens, so more never fit a context

# OpenAI Responses kept for previous_response_id (http/response_store.py): their turns' text,
# in characters, and how many; the least recently used go first.
MAX_STORED_RESPONSES = 4096
MAX_STORED_RESPONSE_BYTES = 256 << 20

MAX_JSON_DEPTH = 128  # arrays/objects inside each other anywhere in a body
MAX_SCHEMA_DEPTH = 64  # objects/arrays inside each other in one JSON schema
MAX_SCHEMA_BYTES = 1 << 20  # one schema, as compact JSON
# maxLength, minLength, maxItems, minItems and a pattern's {m,n}: the grammar spells these
# as repetitions of at most 500 (llama.cpp's parser caps one at 2000), nested, so this is
# how much text such a count can describe, not a cost.
MAX_SCHEMA_COUNT = 1_000_000
MAX_GRAMMAR_BYTES = 4 << 20  # GBNF text, given or converted from a schema
MAX_GRAMMAR_DEPTH = 256  # ( ... ) groups inside each other: llama.cpp's parser recurses
# What llama.cpp builds from the text (llama/gbnf.py counts it first): every group and
# repetition is a rule of its own ("a"{0,1999} is 1999), each element 8 bytes or more.
MAX_GRAMMAR_RULES = 100_000
MAX_GRAMMAR_ELEMENTS = 4_000_000
# Rules each beginning with the next: llama.cpp recurses once per rule along such a chain
# when it advances a parse, on the engine thread for every token.
MAX_GRAMMAR_CHAIN = 10_000
# Parse stacks: llama.cpp tries every candidate token against every stack (~0.5 ms a stack
# at a 49k vocabulary, on the engine thread), and the duplicate check when they are made is
# quadratic. FANOUT bounds what one step can open (checked on the text), STACKS what a
# request may hold while it decodes (checked after every token: an ambiguous grammar can
# double them every token). 128 tools or an enum of 250 values stay within both.
MAX_GRAMMAR_FANOUT = 256
MAX_GRAMMAR_STACKS = 256

# The default body limit: generous bytes per context token (JSON-escaped non-ASCII text
# takes up to 12 bytes a character) plus room for tools, schemas and message framing.
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_EXTRA = 2 << 20


def default_body_bytes(n_ctx: int) -> int:
    """The largest body a context of ``n_ctx`` tokens can use: anything bigger is refused
    before it is read (413 ``body_too_large``)."""
    return BODY_BYTES_PER_TOKEN * n_ctx + BODY_BYTES_EXTRA


@dataclass(frozen=True, slots=True)
class BodyLimit:
    """The body limit the command line chose: a fixed number of bytes
    (``--polykv-max-body-bytes``), or None to derive it from the context size."""

    max_bytes: int | None = None

    def for_context(self, n_ctx: int) -> int:
        return self.max_bytes if self.max_bytes is not None else default_body_bytes(n_ctx)
