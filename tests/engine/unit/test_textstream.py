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
