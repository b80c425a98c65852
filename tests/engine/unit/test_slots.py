"""A slot's turn without a model: what starting a task sets, and the answer it ends with."""

from __future__ import annotations

from polykv_engine.core.slots import Slot
from polykv_engine.core.tasks import Event, GenerateTask
from polykv_engine.llama.sampling import SamplingParams, StopParams
from polykv_engine.policy.tps import SessionRate


class Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def flush(self) -> None:
        pass


def task(prompt: list[int]) -> GenerateTask:
    return GenerateTask(
        prompt=prompt,
        sampling=SamplingParams(temperature=0.0, seed=7),
        stop=StopParams(n_predict=5, stops=("END",)),
        sink=Sink(),
        session_id="s",
    )


def test_a_started_turn_counts_its_reused_prompt_and_reports_its_settings() -> None:
    slot = Slot(0, 256, SessionRate())
    slot.generated, slot.pending = [9, 9], 9  # the last turn's, gone with the new one
    t = task([1, 2, 3, 4])
    slot.start(t, t.sampling, reused=3, now=100.0)
    assert (slot.state, slot.prompt, slot.n_prompt_done) == ("prefill", [1, 2, 3, 4], 3)
    assert slot.n_cached == t.n_cached == 3
    assert (slot.generated, slot.pending, slot.task, slot.seed) == ([], None, t, 7)
    assert slot.params["n_predict"] == 5 and slot.params["stop"] == ["END"]
    assert slot.params["seed"] == 7 and slot.params["grammar"] == ""
    assert slot.t_start == 100.0 and slot.t_first == 0.0
    assert slot.assembler.stops == ["END"]


def test_the_result_times_the_prompt_and_the_generation_apart() -> None:
    slot = Slot(1, 256, SessionRate())
    slot.session_id = "s"
    t = task([1, 2, 3, 4])
    slot.start(t, t.sampling, reused=1, now=10.0)
    slot.t_first = 10.5  # the first token, half a second in
    slot.generated = [5, 6]
    slot.assembler.push(b"hi")
    r = slot.result("limit", truncated=True, now=12.0)
    assert (r.prompt_n, r.cache_n, r.predicted_n) == (3, 1, 2)
    assert (r.prompt_ms, r.predicted_ms) == (500.0, 1500.0)
    assert (r.content, r.tokens, r.stop_type, r.truncated) == ("hi", [5, 6], "limit", True)
    assert (r.slot, r.session_id, r.seed, r.pool_id, r.shared_prefix) == (1, "s", 7, None, 0)


def test_a_turn_that_ends_before_its_first_token_spent_it_all_on_the_prompt() -> None:
    slot = Slot(0, 256, SessionRate())
    t = task([1, 2])
    slot.start(t, t.sampling, reused=0, now=10.0)
    r = slot.result("limit", truncated=False, now=11.0)
    assert (r.prompt_ms, r.predicted_ms, r.predicted_n) == (1000.0, 0.0, 0)
