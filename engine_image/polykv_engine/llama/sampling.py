"""Sampling and stopping settings of one request, as plain data (pure)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from polykv_engine.llama.grammar import Grammar


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: Grammar | None = None  # constrain the output (response_format, tools, GBNF)

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax, as in llama-server."""
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        ) and self.repeat_last_n != 0

    def resolved(self) -> SamplingParams:
        """Replace seed -1 with a concrete random seed so a response can report it."""
        return self if self.seed >= 0 else replace(self, seed=random.getrandbits(32))


@dataclass(frozen=True, slots=True)
class StopParams:
    n_predict: int = -1  # -1: until EOS or the context is full
    stops: tuple[str, ...] = ()
    ignore_eos: bool = False
