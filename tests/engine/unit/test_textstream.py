import random

from polykv_engine.core.textstream import TextAssembler


def feed(asm: TextAssembler, pieces: list[bytes]) -> list[str]:
    return [asm.push(p) for p in pieces]


def test_plain_text_passes_through() -> None:
    asm = TextAssembler()
    assert feed(asm, [b"Hel", b"lo"]) == ["Hel", "lo"]
    assert asm.flush() == ""
    assert asm.text == "Hello"


def test_split_utf8_character_is_held_until_complete() -> None:
    asm = TextAssembler()
    euro = "€".encode()
    assert feed(asm, [euro[:1], euro[1:2], euro[2:]]) == ["", "", "€"]


def test_stop_word_across_tokens_is_never_emitted() -> None:
    asm = TextAssembler(["</s>"])
    out = feed(asm, [b"abc<", b"/", b"s>", b"more"])
    assert "".join(out) == "abc"
    assert asm.stopping_word == "</s>"
    assert asm.text == "abc"


def test_false_alarm_prefix_is_released() -> None:
    asm = TextAssembler(["STOP"])
    out = feed(asm, [b"a S", b"T", b"x"])
    assert out == ["a ", "", "STx"]
    assert asm.stopping_word is None


def test_earliest_of_several_stops_wins() -> None:
    asm = TextAssembler(["world", "lo w"])
    feed(asm, [b"hello world"])
    assert asm.stopping_word == "lo w"
    assert asm.text == "hel"


def test_flush_releases_held_back_partial_stop() -> None:
    asm = TextAssembler(["STOP"])
    assert feed(asm, [b"end ST"]) == ["end "]
    assert asm.flush() == "ST"
    assert asm.text == "end ST"


def test_no_output_after_stop() -> None:
    asm = TextAssembler(["x"])
    feed(asm, [b"ax"])
    assert asm.push(b"more") == ""
    assert asm.flush() == ""


def test_a_cut_inside_a_character_drops_its_bytes_never_u_fffd() -> None:
    asm = TextAssembler()
    euro = "€".encode()
    assert feed(asm, [b"cost: 5", euro[:2]]) == ["cost: 5", ""]
    assert asm.flush() == ""
    assert asm.text == "cost: 5" and "\ufffd" not in asm.text


def test_invalid_bytes_in_the_middle_are_replaced() -> None:
    asm = TextAssembler()
    assert feed(asm, [b"a\xffb"]) == ["a\ufffdb"]


class CountingStr(str):
    """A stop string that counts how often its characters are read."""

    reads = 0

    def __getitem__(self, key: object) -> str:  # type: ignore[override]
        CountingStr.reads += 1
        return str.__getitem__(self, key)  # type: ignore[index]


def test_stop_matching_costs_the_new_text_not_the_stop_length_squared() -> None:
    """16 stops of 20k characters used to cost O(L^2) per token (178 ms a token for every
    session, on the engine thread); each new character now costs each stop O(1) amortized."""
    CountingStr.reads = 0
    stops = [CountingStr(chr(ord("a") + i) * 19_999 + "!") for i in range(16)]
    asm = TextAssembler(list(stops))
    tokens = [b"a", b"ab", b"xyz", b"aaaa"] * 25  # near-misses of every kind
    out = feed(asm, tokens)
    n_chars = sum(len(t) for t in tokens)
    assert CountingStr.reads <= 4 * len(stops) * n_chars, CountingStr.reads
    assert "".join(out) + asm.flush() == b"".join(tokens).decode()


def reference(stops: list[str], pieces: list[str]) -> tuple[list[str], str, str | None]:
    """The quadratic algorithm this replaced: every stop searched, every prefix tried."""
    text, emitted, out = "", 0, []
    for piece in pieces:
        text += piece
        hits = [(text.find(w), i, w) for i, w in enumerate(stops) if w in text]
        if hits:  # the earliest; on a tie, the first listed
            pos, _, word = min(hits)
            out.append(text[emitted:pos])
            return out, text[:pos], word
        held = 0
        for w in stops:
            for n in range(min(len(w) - 1, len(text)), 0, -1):
                if text.endswith(w[:n]):
                    held = max(held, n)
                    break
        upto = max(emitted, len(text) - held)
        out.append(text[emitted:upto])
        emitted = upto
    return out, text, None


def test_matches_the_quadratic_algorithm_on_random_streams() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        alphabet = "ab" if rng.random() < 0.5 else "abc"
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
            for _ in range(rng.randint(1, 4))
        ]
        pieces = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 12))
        ]
        asm = TextAssembler(list(stops))
        got = [asm.push(p.encode()) for p in pieces if asm.stopping_word is None]
        want, text, word = reference(stops, pieces)
        assert (got, asm.text, asm.stopping_word) == (want, text, word), (stops, pieces)
