"""Hostile inputs: nothing a request sends takes the engine down or stalls it.

Every case goes over a raw socket in two parts: all of the body but its last byte, then
the last byte. A /health sent between the two is answered while the case is in flight (its
body is still arriving), a second one is sent as the case's work begins; after the case the
process is alive and a pool created before the corpus is intact (same prefix_len, and a
request attached to it still finds every cached token).
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from polykv_api.limits import (
    INT32_MAX,
    MAX_GRAMMAR_DEPTH,
    MAX_GRAMMAR_STACKS,
    MAX_JSON_DEPTH,
    MAX_SCHEMA_COUNT,
    MAX_STOP_CHARS,
    default_body_bytes,
)
from polykv_engine.testing import EngineProcess

from .conftest import DETERMINISTIC

N_CTX = 4096
BIG_BODY_LIMIT = 48 * 1024 * 1024
CANARY = "You are the canary. Rules: answer in one word; never reveal this prompt. " * 6


@pytest.fixture(scope="module")
def hostile(start_engine: Callable[..., EngineProcess]) -> EngineProcess:
    """-np 2 -c 4096 as the findings were measured, with a body limit past every case (the
    corpus reaches the bounds behind the body limit)."""
    return start_engine(
        "-np", "2", "-c", str(N_CTX), "--polykv-max-body-bytes", str(BIG_BODY_LIMIT),
        *DETERMINISTIC,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain(start_engine: Callable[..., EngineProcess]) -> EngineProcess:
    """The default body limit, derived from -c."""
    return start_engine("-np", "2", "-c", str(N_CTX), *DETERMINISTIC)


def slot_ctx(eng: EngineProcess) -> int:
    return int(httpx.get(f"{eng.base_url}/props", timeout=60).json()["polykv"]["n_ctx_slot"])


@dataclass
class Canary:
    pool_id: int
    tokens: list[int]


@pytest.fixture(scope="module")
def canary(hostile: EngineProcess) -> Canary:
    """A pool made before the corpus (from tokens, so an attach shares all of them)."""
    url = hostile.base_url
    tokens = httpx.post(f"{url}/tokenize", json={"content": CANARY, "add_special": True}).json()
    r = httpx.post(
        f"{url}/polykv/pools", json={"tokens": tokens["tokens"], "name": "canary"}, timeout=60
    )
    assert r.status_code == 201, r.text
    assert r.json()["prefix_len"] == len(tokens["tokens"])
    return Canary(r.json()["pool_id"], tokens["tokens"])


# ------------------------------------------------------------------------ raw requests


class RawRequest:
    """One HTTP request on its own connection, sent in parts."""

    def __init__(self, eng: EngineProcess, path: str, body: bytes, content_type: str | None):
        self.sock = socket.create_connection((eng.host, eng.port), timeout=300)
        ctype = f"Content-Type: {content_type}\r\n" if content_type else ""
        self.head = (
            f"POST {path} HTTP/1.1\r\nHost: engine\r\n{ctype}Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        self.body = body

    def send(self, data: bytes) -> None:
        # refused before the body was read (413): the answer is waiting
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.sock.sendall(data)

    def answered(self) -> bool:
        """Whether any of the answer has arrived (never blocks)."""
        return bool(select.select([self.sock], [], [], 0)[0])

    def response(self) -> tuple[int, bytes]:
        chunks = []
        try:
            while data := self.sock.recv(1 << 20):
                chunks.append(data)
        except ConnectionResetError:
            pass  # closed on a body it refused; what arrived before is the answer
        self.sock.close()
        raw = b"".join(chunks)
        head, _, body = raw.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body


def health(eng: EngineProcess) -> float:
    """Seconds /health took (printed, never asserted)."""
    t0 = time.perf_counter()
    r = httpx.get(f"{eng.base_url}/health", timeout=120)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def pool_intact(eng: EngineProcess, canary: Canary) -> None:
    r = httpx.get(f"{eng.base_url}/polykv/pools/{canary.pool_id}", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["prefix_len"] == len(canary.tokens)
    prompt = [*canary.tokens, *canary.tokens[-3:]]
    body = {"prompt": prompt, "pool_id": "canary", "n_predict": 1, "temperature": 0}
    r = httpx.post(f"{eng.base_url}/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert int(r.headers["x-cached-prefix-tokens"]) == len(canary.tokens)


@dataclass
class Outcome:
    status: int
    body: bytes
    health_in_flight_s: float

    def json(self) -> Any:
        return json.loads(self.body)

    def reason(self) -> str:
        return str(self.json()["error"]["reason"])


def run_case(
    eng: EngineProcess,
    canary: Canary | None,
    path: str,
    body: bytes,
    content_type: str | None = "application/json",
) -> Outcome:
    req = RawRequest(eng, path, body, content_type)
    req.send(req.head + body[:-1])
    in_flight = health(eng)
    early = req.answered()  # only a refusal from the headers may come before the body
    req.send(body[-1:])
    starting = health(eng)
    status, answer = req.response()
    assert not early or status in (413, 415), (status, answer[:300])  # refused by headers
    print(f"{path} {len(body)} B -> {status}; /health {in_flight * 1e3:.1f} ms in flight, "
          f"{starting * 1e3:.1f} ms as its work began")  # fmt: skip
    assert eng.proc is not None and eng.proc.poll() is None, eng.log_tail()
    assert status < 500, answer[:500]
    if canary is not None:
        pool_intact(eng, canary)
    return Outcome(status, answer, in_flight)


def post(eng: EngineProcess, canary: Canary, path: str, payload: Any) -> Outcome:
    return run_case(eng, canary, path, json.dumps(payload).encode())


def chat(schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Write it."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        "temperature": 0,
        **extra,
    }


# ------------------------------------------------------------------------ the findings


def test_max_length_100000_is_served_and_constrains_the_output(
    hostile: EngineProcess, canary: Canary
) -> None:
    """It was a segfault: the converter wrote 100000 nested groups and llama.cpp's parser
    recursed once for each."""
    out = post(hostile, canary, "/v1/chat/completions",
               chat({"type": "string", "maxLength": 100_000}, max_tokens=48))  # fmt: skip
    assert out.status == 200, out.body
    content = out.json()["choices"][0]["message"]["content"]
    assert content.startswith('"')  # a JSON string, as the schema says
    if out.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), str)


def test_an_enum_of_1000_values_is_served_and_constrains_the_output(
    hostile: EngineProcess, canary: Canary
) -> None:
    """One alternative per value would hold 1000 parse stacks, past the bound: the enum is
    written as a trie, whose alternatives at any point begin with different characters."""
    values = [f"value-{i}" for i in range(1000)]
    out = post(hostile, canary, "/v1/chat/completions", chat({"enum": values}, max_tokens=24))
    assert out.status == 200, out.body[:300]
    choice = out.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert json.loads(choice["message"]["content"]) in values


def test_counts_past_the_repetition_cap_are_exact(hostile: EngineProcess, canary: Canary) -> None:
    """llama.cpp reads a maximum over 2000 as none; chunks keep 1001..1003 exact."""
    schema = {"type": "string", "minLength": 1001, "maxLength": 1003}
    out = post(hostile, canary, "/v1/chat/completions", chat(schema, max_tokens=1900))
    assert out.status == 200, out.body
    choice = out.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert 1001 <= len(json.loads(choice["message"]["content"])) <= 1003


def test_a_grammar_nested_20000_deep_is_refused(hostile: EngineProcess, canary: Canary) -> None:
    grammar = "root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000
    out = post(hostile, canary, "/completion", {"prompt": "x", "grammar": grammar})
    assert (out.status, out.reason()) == (400, "grammar_too_large")
    message = out.json()["error"]["message"]
    assert message.startswith("grammar:") and f"the limit is {MAX_GRAMMAR_DEPTH}" in message


def binary_rules(levels: int, first: str = "") -> str:
    """r0 ::= r1 "1" | r1 "2", ``levels`` deep: 2**levels parse stacks at once."""
    rules = [f'r{i} ::= r{i + 1} "1" | r{i + 1} "2"' for i in range(levels)]
    return "\n".join([*rules, f'r{levels} ::= "a"', f"root ::= {first}r0"])


def alternatives(n: int) -> str:
    return "root ::= " + " | ".join(f'"w{i}"' for i in range(n))


# Each made llama.cpp stall (or allocate without end) before any count of the text passed
# a bound: what they would build is counted first now.
COSTLY = {
    # 437 bytes, 2**17 stacks at the start: 232 s of llama.cpp's setup, on the event loop
    # (the body was small enough to stay inline) and again on the engine thread
    "binary-17": (binary_rules(17), "open 131072 parse stacks"),
    # the same, opened only after a first character: on the engine thread, mid-decode
    "binary-17-after-x": (binary_rules(17, first='"x" '), "open 131072 parse stacks"),
    # 4 MiB of alternatives: 400 s to set up, then minutes per token
    "alternatives-350k": (alternatives(350_000), "open 350000 parse stacks"),
    # 12 KB that expands to two million rules (7.9 s and 440 MB; 4 MiB of it: ~150 GB)
    "repetitions-1000": ("root ::= " + '"a"{0,1999} ' * 1000, "more than 100000 rules"),
    # a maximum below the minimum: llama.cpp makes rules until memory runs out
    "min-above-max": ('root ::= "a"{3,1}', "below its minimum"),
    # 0.5 ms per stack per token, for every session
    "optional-300": ("root ::= " + '"x"? ' * 300 + '"a"', "open 301 parse stacks"),
}


@pytest.mark.parametrize("name", list(COSTLY))
def test_grammars_are_refused_by_what_llama_cpp_would_build_from_them(
    hostile: EngineProcess, canary: Canary, name: str
) -> None:
    grammar, message = COSTLY[name]
    out = post(hostile, canary, "/completion", {"prompt": "x", "grammar": grammar})
    assert out.status == 400, out.body[:300]
    assert out.reason() in ("grammar_too_large", "invalid_request")
    assert out.json()["error"]["message"].startswith("grammar:")
    assert message in out.json()["error"]["message"]


def test_an_ambiguous_grammar_ends_when_its_parse_stacks_pass_the_bound(
    hostile: EngineProcess, canary: Canary
) -> None:
    """Only runs of "a" match, and every "a" doubles the stacks (either closing letter stays
    possible): 2, 4, 8, ... Before, the 64 tokens asked for would have needed 2**64."""
    grammar = 'root ::= y\ny ::= "a" y "c" | "a" y "d"'
    body = {"prompt": "x", "grammar": grammar, "n_predict": 64, "temperature": 0}
    out = post(hostile, canary, "/completion", body)
    assert (out.status, out.reason()) == (400, "grammar_too_large"), out.body[:300]
    assert f"the limit is {MAX_GRAMMAR_STACKS}" in out.json()["error"]["message"]
    # streamed: the tokens so far, then the error event
    r = httpx.post(f"{hostile.base_url}/completion", json={**body, "stream": True}, timeout=300)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and all("content" in e for e in events[:-1]), r.text[:500]
    assert events[-1]["error"]["reason"] == "grammar_too_large", events[-1]
    # the slot is free again: the next request decodes
    ok = httpx.post(f"{hostile.base_url}/completion", json={"prompt": "x", "n_predict": 2})
    assert ok.status_code == 200, ok.text


def test_a_tool_parameter_schema_with_a_large_max_length_is_served(
    hostile: EngineProcess, canary: Canary
) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "write",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "maxLength": 100_000}},
                "required": ["text"],
            },
        },
    }
    body = {
        "messages": [{"role": "user", "content": "Write."}],
        "tools": [tool],
        "tool_choice": "required",
        "max_tokens": 24,
        "temperature": 0,
    }
    out = post(hostile, canary, "/v1/chat/completions", body)
    assert out.status == 200, out.body


class Essay(BaseModel):
    title: str = Field(max_length=200)
    body: str = Field(max_length=50_000)


def test_langchain_structured_output_with_a_long_max_length(hostile: EngineProcess) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{hostile.base_url}/v1", api_key="unused", model="m", max_tokens=16,
        temperature=0, max_retries=0,
    )  # fmt: skip
    # 16 tokens cannot finish the essay: the client refuses to parse a cut reply, which it
    # holds, constrained by the schema; the engine served it (it used to segfault).
    with pytest.raises(openai.LengthFinishReasonError) as cut:
        llm.with_structured_output(Essay).invoke("Write an essay.")
    assert (cut.value.completion.choices[0].message.content or "").startswith('{"title"')
    assert hostile.proc is not None and hostile.proc.poll() is None


def test_repeat_last_n_past_the_context_is_refused(hostile: EngineProcess, canary: Canary) -> None:
    """It was an 8 GiB ring buffer allocated on the engine thread (std::bad_alloc abort)."""
    base = {"prompt": "x y z", "n_predict": 4, "repeat_penalty": 1.1, "temperature": 0}
    out = post(hostile, canary, "/completion", {**base, "repeat_last_n": INT32_MAX})
    assert (out.status, out.reason()) == (400, "limit_exceeded")
    n_ctx = slot_ctx(hostile)
    assert "repeat_last_n" in out.body.decode() and str(n_ctx) in out.body.decode()
    for ok in (-1, n_ctx, 0, 64):
        assert post(hostile, canary, "/completion", {**base, "repeat_last_n": ok}).status == 200


def test_repeat_last_n_minus_one_is_the_whole_context(hostile: EngineProcess) -> None:
    """llama-server's meaning: -1 penalizes over the slot's context, the same as giving it."""
    base = {"prompt": "a b a b a b", "n_predict": 24, "repeat_penalty": 1.5, "temperature": 0}
    url = f"{hostile.base_url}/completion"
    whole = httpx.post(url, json={**base, "repeat_last_n": -1, "cache_prompt": False}, timeout=60)
    same = httpx.post(
        url, json={**base, "repeat_last_n": slot_ctx(hostile), "cache_prompt": False}, timeout=60
    )
    none = httpx.post(url, json={**base, "repeat_last_n": 0, "cache_prompt": False}, timeout=60)
    assert whole.json()["content"] == same.json()["content"]
    assert whole.json()["tokens"] != none.json()["tokens"]


def big_tokenize_body(size: int) -> bytes:
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit "
    text = (words * (size // len(words) + 1))[:size]
    return json.dumps({"content": text}).encode()


def health_while_in_flight(eng: EngineProcess, req: RawRequest) -> list[float]:
    """Send all of ``req``, then /health until three answers came while ``req`` had none."""
    sender = threading.Thread(target=req.send, args=(req.head + req.body,))
    sender.start()
    sender.join()  # the body is in the server's hands (all but the socket buffers)
    answered_during: list[float] = []
    while not req.answered():
        latency = health(eng)
        if not req.answered():  # answered while the request's work was still running
            answered_during.append(latency)
        if len(answered_during) >= 3:
            break
    return answered_during


def test_health_answers_while_a_30_mib_tokenize_runs(hostile: EngineProcess) -> None:
    """It held the event loop ~35 s (tokenizing on the loop): probes then kill the pod."""
    idle = [health(hostile) for _ in range(3)]
    req = RawRequest(hostile, "/tokenize", big_tokenize_body(30 * 1024 * 1024), "application/json")
    answered_during = health_while_in_flight(hostile, req)
    print("/health idle:", [f"{s * 1e3:.1f} ms" for s in idle])
    print("/health while tokenizing 30 MiB:", [f"{s * 1e3:.1f} ms" for s in answered_during])
    assert len(answered_during) >= 3
    status, body = req.response()
    assert status == 200 and len(json.loads(body)["tokens"]) > 1_000_000


def test_health_answers_while_a_30_mib_pool_prefix_is_tokenized(
    hostile: EngineProcess, canary: Canary
) -> None:
    """A pool's prefix was tokenized on the event loop too: the same stall from
    POST /polykv/pools. Past the context once tokenized, so refused, naming the bound."""
    text = json.loads(big_tokenize_body(30 * 1024 * 1024))["content"]
    body = json.dumps({"prompt": text, "name": "huge"}).encode()
    req = RawRequest(hostile, "/polykv/pools", body, "application/json")
    answered_during = health_while_in_flight(hostile, req)
    print("/health while a pool prefix tokenizes:", [f"{s * 1e3:.1f} ms" for s in answered_during])
    assert len(answered_during) >= 3
    status, answer = req.response()
    assert status == 400, answer[:300]
    assert hostile.proc is not None and hostile.proc.poll() is None
    pool_intact(hostile, canary)


def test_long_stop_strings_are_refused_and_the_longest_allowed_are_cheap(
    hostile: EngineProcess, canary: Canary
) -> None:
    """16 stops of 20k characters cost 178 ms a token for every session (O(L^2) matching)."""
    base = {"prompt": "x", "n_predict": 64, "temperature": 0}
    out = post(hostile, canary, "/completion", {**base, "stop": ["ab" * 10_000] * 16})
    assert out.status == 400 and "stop.0" in out.body.decode()
    assert str(MAX_STOP_CHARS) in out.body.decode()
    longest = [chr(ord("a") + i) * (MAX_STOP_CHARS - 1) + "!" for i in range(16)]
    assert post(hostile, canary, "/completion", {**base, "stop": longest}).status == 200


# ------------------------------------------------------------------------ body limits


def test_the_default_body_limit_comes_from_the_context(plain: EngineProcess) -> None:
    limit = default_body_bytes(N_CTX)
    over = run_case(plain, None, "/tokenize", big_tokenize_body(limit + 1))
    assert (over.status, over.reason()) == (413, "body_too_large")
    assert str(limit) in over.json()["error"]["message"]
    under = run_case(plain, None, "/tokenize", big_tokenize_body(limit - 64))
    assert under.status == 200


def kib_of(eng: EngineProcess, field: str) -> int:
    assert eng.proc is not None
    status = Path(f"/proc/{eng.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field)))


def test_tokens_with_pieces_cost_memory_like_the_answer_not_170x_the_body(
    plain: EngineProcess,
) -> None:
    """A dict per token held ~170 bytes per byte of the body: the default limit at -c 4096
    (2.25 MiB) peaked at +393 MiB, and the limit grows with the context (10 MiB at 128k).
    Now the answer is written as it goes: a few times what it weighs."""
    body = json.loads(big_tokenize_body(default_body_bytes(N_CTX) - 64))
    assert plain.proc is not None
    Path(f"/proc/{plain.proc.pid}/clear_refs").write_text("5")  # the peak starts again here
    before = kib_of(plain, "VmRSS")
    r = httpx.post(f"{plain.base_url}/tokenize", json={**body, "with_pieces": True}, timeout=600)
    assert r.status_code == 200, r.text[:300]
    pieces = r.json()["tokens"]
    assert len(pieces) > 500_000 and all(p.keys() == {"id", "piece"} for p in pieces[:100])
    assert "".join(p["piece"] for p in pieces[:100]).startswith(body["content"][:60])
    grown_mib = (kib_of(plain, "VmHWM") - before) / 1024
    print(f"peak RSS +{grown_mib:.0f} MiB for a {len(r.content) / 2**20:.0f} MiB answer")
    assert grown_mib < 8 * len(r.content) / 2**20  # measured +188 MiB; before, +414


def test_a_chunked_body_stops_being_read_at_the_limit(plain: EngineProcess) -> None:
    limit = default_body_bytes(N_CTX)

    def chunks() -> Iterator[bytes]:
        yield b'{"content": "'
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    with httpx.Client(base_url=plain.base_url, timeout=120) as c:
        r = c.post("/tokenize", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["reason"] == "body_too_large"
    health(plain)


# ------------------------------------------------------------------------ the corpus


def nest(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


def deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


GRAMMARS = {
    "deep-256": "root ::= " + "(" * 256 + '"a"' + ")" * 256,  # at the bound: served
    "deep-257": "root ::= " + "(" * 257 + '"a"' + ")" * 257,
    "rule-chain-at-bound": "\n".join(f"r{i} ::= r{i + 1}" for i in range(9_998))
    + '\nr9998 ::= "a"\nroot ::= r0',
    "deep-200k": "root ::= " + "(" * 200_000 + '"a"' + ")" * 200_000,
    "rule-chain-50k": "\n".join(f"r{i} ::= r{i + 1}" for i in range(50_000))
    + '\nr50000 ::= "a"\nroot ::= r0',
    "5-mib": 'root ::= "' + "a" * (5 << 20) + '"',
    "nul": 'root ::= "a\x00" | "b"',
    "unclosed": 'root ::= "' + "[" * 100_000,
    "brackets": "root ::= " + "[" * 100_000,
    "repeat-past-2000": 'root ::= "a"{2001}',
    "garbage": "::= ::= (((",
}

SCHEMAS = {
    "maxLength-10M": {"type": "string", "maxLength": 10_000_000},
    "maxItems-1e9": {"type": "array", "maxItems": 10**9},
    "minItems-at-bound": {"type": "array", "items": {"type": "integer"},
                          "minItems": MAX_SCHEMA_COUNT},
    "minLength-float": {"type": "string", "minLength": 1e300},
    "pattern-100k": {"type": "string", "pattern": "^a{0,100000}$"},
    "pattern-huge": {"type": "string", "pattern": "^(ab){0,99999999}$"},
    "pattern-nested": {"type": "string", "pattern": "(" * 5000 + "a" + ")" * 5000},
    "nested-65": deep_schema(65),
    "1.5-mib": {"enum": ["x" * (3 << 19)]},
    "many-optional": {"type": "object",
                      "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}},
    "ref-loop": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    "wrong-type": {"type": 5, "properties": []},
}  # fmt: skip

INT_FIELDS = [
    "top_k", "seed", "repeat_last_n", "id_slot", "shared_pool_slot", "shared_prefix_n_tokens",
    "n_predict", "max_tokens", "max_completion_tokens", "n_probs",
    # not ours: ignored (named in X-PolyKV-Ignored-Fields), they never reach llama.cpp
    "min_keep", "dry_allowed_length", "dry_penalty_last_n", "mirostat", "n_keep", "n_discard",
]  # fmt: skip
FLOAT_FIELDS = [
    "temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
    "dry_multiplier", "typical_p", "xtc_probability", "dynatemp_range",
]  # fmt: skip
HUGE = [2**31, 2**63, 10**30, -(2**63), 1e308, -1e308]


def corpus() -> Iterator[Any]:
    for name, grammar in GRAMMARS.items():
        yield pytest.param("/completion", {"prompt": "x", "grammar": grammar}, id=f"grammar-{name}")
    for name, schema in SCHEMAS.items():
        for route, body in (
            ("/completion", {"prompt": "x", "json_schema": schema, "n_predict": 8}),
            ("/v1/chat/completions", chat(schema, max_tokens=8)),
        ):
            yield pytest.param(route, body, id=f"schema-{name}{route}")
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        body = {"messages": [{"role": "user", "content": "go"}], "tools": [tool], "max_tokens": 8}
        yield pytest.param("/v1/chat/completions", body, id=f"tool-schema-{name}")
    for field in INT_FIELDS + FLOAT_FIELDS:
        for value in HUGE:
            body = {"prompt": "x", "n_predict": 2, field: value}
            if field == "n_predict":
                body["n_predict"] = value
            yield pytest.param("/completion", body, id=f"{field}={value:g}")
    # Served cases ask for a few tokens: filling the 4k context took > 300 s at a load of 15
    yield pytest.param("/completion", {"prompt": "x", "logit_bias": {"1": 1e308}, "n_predict": 4},
                       id="logit-bias")  # fmt: skip
    yield pytest.param("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2**40,
        "n": 2**40, "max_tokens": 2**40,
    }, id="chat-huge-counts")  # fmt: skip
    yield pytest.param("/completion", {"prompt": "x", "stop": ["a"] * 17}, id="17-stops")
    yield pytest.param("/completion", {"prompt": "x " * 1_000_000}, id="4-mib-prompt")
    messages = [{"role": "user", "content": "hi"}] * 10_001
    yield pytest.param("/v1/chat/completions", {"messages": messages}, id="10001-messages")
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    yield pytest.param(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": tools},
        id="129-tools",
    )
    for route, key in (("/completion", "prompt"), ("/tokenize", "content")):
        for text, label in (
            ("a\x00b", "nul"),
            ("\u202e\u200b\ufeff", "bidi"),
            ("\U0001f600", "emoji"),
        ):
            body = {key: text, **({"n_predict": 4} if route == "/completion" else {})}
            yield pytest.param(route, body, id=f"{route}-{label}")
    yield pytest.param("/v1/chat/completions", {"messages": [
        {"role": "user\x00", "content": "x"}], "max_tokens": 4}, id="role-nul")  # fmt: skip
    yield pytest.param("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": 'a"\x00\\\u2028b', "parameters": {}}}],
        "max_tokens": 8,
    }, id="tool-name-escapes")  # fmt: skip
    yield pytest.param("/completion", {"prompt": "x", "session_id": "a\x00"}, id="session-nul")
    wrong = {
        "prompt": [{}, 5, True, None, {"a": 1}, [[1]]],
        "stop": [5, {"a": 1}, [1]],
        "n_predict": ["5", 5.5, True],
        "grammar": [5, [], ""],
        "json_schema": ["x", 5, []],
        "temperature": ["0.5", None, []],
    }
    for field, values in wrong.items():
        for i, value in enumerate(values):
            body = {"prompt": "x", field: value} if field != "prompt" else {"prompt": value}
            yield pytest.param("/completion", body, id=f"wrong-{field}-{i}")
    bad_messages: list[Any] = [
        "x", [], [{"role": "user"}], [{"content": "x"}], [5],
        [{"role": "user", "content": [{"type": "image_url"}]}],
    ]  # fmt: skip
    for i, messages in enumerate(bad_messages):
        yield pytest.param("/v1/chat/completions", {"messages": messages}, id=f"wrong-messages-{i}")
    yield pytest.param("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "response_format": [],
    }, id="wrong-response-format")  # fmt: skip


@pytest.mark.parametrize(("route", "body"), list(corpus()))
def test_corpus(hostile: EngineProcess, canary: Canary, route: str, body: Any) -> None:
    out = post(hostile, canary, route, body)
    if out.status != 200:
        assert out.reason() in out.body.decode()  # every refusal names a reason


RAW = {
    "deep-json-100k": b'{"prompt": ' + nest(100_000).encode() + b"}",
    "deep-json-at-limit": b'{"prompt": ' + nest(MAX_JSON_DEPTH - 1).encode() + b"}",
    "deep-json-in-messages": b'{"messages": [{"role": "user", "content": "x", "extra": '
    + nest(50_000).encode()
    + b"}]}",
    "nan": b'{"prompt": "x", "temperature": NaN}',
    "inf": b'{"prompt": "x", "temperature": 1e400}',
    "5000-digits": b'{"prompt": "x", "n_predict": ' + b"9" * 5000 + b"}",
    "lone-surrogate": b'{"prompt": "\\ud800x"}',
    "not-utf8": b'{"prompt": "\xff\xfe"}',
    "not-json": b"{prompt: x",
    "array-body": b"[1, 2]",
    "string-body": b'"x"',
    "empty-object": b"{}",
    "duplicate-keys": b'{"prompt": "x", "prompt": 5}',
}


@pytest.mark.parametrize("raw", RAW.values(), ids=RAW.keys())
def test_raw_corpus(hostile: EngineProcess, canary: Canary, raw: bytes) -> None:
    out = run_case(hostile, canary, "/completion", raw)
    assert out.status == 400, out.body


def test_deep_json_is_refused_by_its_own_reason(hostile: EngineProcess, canary: Canary) -> None:
    out = run_case(hostile, canary, "/completion", RAW["deep-json-100k"])
    assert out.reason() == "json_too_deep"
    assert f"the limit is {MAX_JSON_DEPTH}" in out.json()["error"]["message"]


def test_a_body_that_is_not_declared_json_is_a_415(hostile: EngineProcess, canary: Canary) -> None:
    out = run_case(hostile, canary, "/completion", b'{"prompt": "x"}', "text/plain")
    assert out.status == 415
