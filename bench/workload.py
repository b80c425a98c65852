"""What the benchmarks send: deterministic text and prompts, and token workloads made once
through an engine's tokenizer (the same model everywhere, so every server gets the same
tokens)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .engine_client import Api
from .harness import BenchError

WORDS = (  # noqa: SIM905
    "the river city morning light garden window story old friend quiet market winter "
    "train letter music road table house evening summer child teacher paper bridge "
    "forest mountain small bright cold long early simple warm green blue open walked "
    "found carried asked watched opened remembered"
).split()
# Private suffixes of pool_sharing and spawn_ramp: 50-100 tokens each.
SUFFIX_MIN, SUFFIX_MAX = 50, 100


def word_text(seed: str, n_words: int) -> str:
    """Deterministic filler text."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def filler_tokens(api: Api, head: str, seed: str, n_tokens: int) -> list[int]:
    """Exactly ``n_tokens`` of ``head`` and deterministic filler, as the engine tokenizes."""
    tokens = api.tokenize(head + word_text(seed, n_tokens), add_special=True)
    if len(tokens) < n_tokens:
        raise BenchError(f"the filler {seed!r} gave only {len(tokens)} of {n_tokens} tokens")
    return tokens[:n_tokens]


def note_prompt(rep: int, k: int, i: int, n_words: int) -> str:
    """A deterministic prompt, distinct per (repeat, level, session)."""
    rng = random.Random(f"{rep}/{k}/{i}")
    words = [rng.choice(WORDS) for _ in range(n_words)]
    return f"Note {rep * 100 + k * 10 + i}: " + " ".join(words).capitalize() + "."


@dataclass
class Workload:
    """Token lists, made once through the first engine's tokenizer (same model everywhere)."""

    prefix: list[int]
    stream: list[int]  # filler tokens cut into suffixes and tails
    _next: int = 0
    _suffixes: dict[tuple[int, int, str], list[list[int]]] = field(default_factory=dict)

    def take(self, n: int) -> list[int]:
        """The next ``n`` unused filler tokens."""
        if self._next + n > len(self.stream):
            raise BenchError("the filler token stream is exhausted: raise its size")
        out = self.stream[self._next : self._next + n]
        self._next += n
        return out

    def suffixes(self, rep: int, k: int, tag: str) -> list[list[int]]:
        """k private suffixes of 50-100 tokens, the same for every engine asking for
        (rep, k, tag); their lengths depend on (rep, k, i) only, not on ``tag``."""
        key = (rep, k, tag)
        if key not in self._suffixes:
            lengths = [
                random.Random(f"{rep}/{k}/{i}").randint(SUFFIX_MIN, SUFFIX_MAX) for i in range(k)
            ]
            self._suffixes[key] = [self.take(n) for n in lengths]
        return self._suffixes[key]


def make_workload(api: Api, prefix_tokens: int, stream_tokens: int) -> Workload:
    head = "Shared instructions for every agent in this team. "
    prefix = api.tokenize(head + word_text("prefix", prefix_tokens), add_special=True)
    if len(prefix) < prefix_tokens:
        raise BenchError(f"prefix text gave only {len(prefix)} tokens")
    stream: list[int] = []
    chunk = 0
    while len(stream) < stream_tokens:
        stream += api.tokenize(" " + word_text(f"filler-{chunk}", 4000), add_special=False)
        chunk += 1
    return Workload(prefix[:prefix_tokens], stream[:stream_tokens])
