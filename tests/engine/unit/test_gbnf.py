"""What llama.cpp would build from a GBNF grammar, counted before it sees it (pure).
Agreement with llama.cpp's own counts is in tests/engine/http/test_grammar_shape.py."""

from __future__ import annotations

import pytest

from polykv_engine.llama.gbnf import GbnfError, GbnfTooLarge, shape

BIG = 10**9


def binary(levels: int, prefix: str = "") -> str:
    rules = [f'r{i} ::= r{i + 1} "1" | r{i + 1} "2"' for i in range(levels)]
    return "\n".join([*rules, f'r{levels} ::= "a"', f"root ::= {prefix}r0"])


def test_groups_and_repetitions_are_rules_as_llama_cpp_expands_them() -> None:
    assert shape('root ::= "a"', BIG, BIG).rules == 1
    assert shape('root ::= ("a" | "b") "c"', BIG, BIG).rules == 2
    assert shape('root ::= "a"{0,1999}', BIG, BIG).rules == 2000  # S'(1) .. S'(1999)
    assert shape('root ::= "a"{3}', BIG, BIG).rules == 1  # copied in place
    assert shape('root ::= "a"* "b"+ "c"?', BIG, BIG).rules == 4
    # elements: each literal character, class range, reference, and an END per alternative
    assert shape('root ::= "abc" [a-z] x\nx ::= "y"', BIG, BIG).elements == 3 + 2 + 1 + 1 + 2


def test_counting_stops_at_the_bound() -> None:
    reps = "root ::= " + " ".join('"a"{0,1999}' for _ in range(1000))  # 12 KB, 2M rules
    with pytest.raises(GbnfTooLarge, match="more than 100000 rules"):
        shape(reps, 100_000, BIG)
    with pytest.raises(GbnfTooLarge, match="elements"):
        shape('root ::= "' + "x" * 5000 + '"{2000}', BIG, 1_000_000)


def test_fanout_counts_the_stacks_one_step_can_open() -> None:
    assert shape('root ::= "a" | "b" | "c"', BIG, BIG).fanout == 3
    assert shape(binary(8), BIG, BIG).fanout == 256  # llama.cpp: 256 stacks at the start
    # behind a first character too: after "x", advancing opens 2**17
    assert shape(binary(17, prefix='"x" '), BIG, BIG).fanout == 2**17
    # optional items in a row: each may be skipped, so all of them are open at once
    assert shape("root ::= " + '"x"? ' * 50 + '"a"', BIG, BIG).fanout == 51
    # empty alternatives multiply the paths (and saturate rather than grow without end)
    empties = "root ::= " + '("" | "") ' * 200 + '"a"'
    assert shape(empties, BIG, BIG).fanout >= 2**61


def test_chain_is_the_longest_run_of_rules_each_beginning_with_the_next() -> None:
    chain = "\n".join(f"r{i} ::= r{i + 1}" for i in range(99)) + '\nr99 ::= "a"\nroot ::= r0'
    assert shape(chain, BIG, BIG).chain == 101
    assert shape('root ::= "x" a\na ::= b "y"\nb ::= "z"', BIG, BIG).chain == 2
    assert shape("root ::= " + "(" * 40 + '"a"' + ")" * 40, BIG, BIG).chain == 41


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('root ::= "a"{3,1}', "below its minimum"),  # llama.cpp: rules until memory runs out
        ('root ::= "a"{2001}', "more than 2000"),
        ('root ::= ("a"{0,50}){0,50}', "too many rules"),  # 51 rules, 50 times
        ("root ::= x", "never defined"),
        ("root ::= root", "left recursion"),
        ('root ::= x "a"\nx ::= "b"? root', "left recursion"),
        ('root ::= "a', "end of input"),
        ("root ::= [a", "end of input"),
        ('root ::= "\\q"', "unknown escape"),
        ('root ::= "\\x4"', "hex digits"),
        ('root ::= ("a"', "expecting '[)]'"),
        ("root = x", "expecting ::="),
        ('root ::= *"a"', "before the repetition"),
        ('root ::= "a" )', "newline or end"),
        ("root ::= <[9999999999]>", "too big"),
    ],
)
def test_what_llama_cpp_refuses_is_refused(text: str, error: str) -> None:
    with pytest.raises(GbnfError, match=error):
        shape(text, BIG, BIG)


def test_the_syntax_llama_cpp_reads() -> None:
    grammar = r"""
# comments, escapes, classes, tokens, any character, nested groups over lines
root   ::= greeting ( " " name )* "\n"   # trailing comment
greeting ::= "h\x65llo" | "\u00e9t\U0001F600" | [^\]\-] . <[12]> !<[13]>
name   ::= (
    [a-zA-Z] [a-z0-9-]{0,10}
  | "anon"
)
"""
    s = shape(grammar, BIG, BIG)
    # root, greeting, name, two groups, the * rule, and 10 rules for {0,10}
    assert s.rules == 16 and s.fanout <= 4
