"""The shape of a GBNF grammar as llama.cpp will build it, read before llama.cpp sees it
(pure).

llama.cpp samples under a grammar by keeping one *parse stack* per way the output so far can
continue, and looks at every stack for every candidate token. Two things about a grammar
decide what that costs, and neither shows in its size:

* **rules**: the parser turns every group and repetition into rules of its own
  (``"a"{0,1999}`` alone makes 1999), so 12 KB of text can ask for two million rules and
  gigabytes; ``rules`` and ``elements`` count what it will allocate. (``"a"{3,1}``, a
  maximum below the minimum, makes rules until memory runs out: refused here.)
* **chain**: the longest run of rules each beginning with the next. llama.cpp recurses once
  per rule along it while it advances a stack, on the engine thread for every token.
* **fan-out**: how many stacks one step can open. ``r0 ::= r1 "1" | r1 "2"``, seventeen rules
  deep, opens 2**17 stacks at the start: 437 bytes that took llama.cpp 232 s to set up (its
  duplicate check is quadratic in the stacks) and would then cost seconds per token. For
  every point of every alternative ``fanout`` counts the stacks that advancing from there
  opens before the next character (paths through empty alternatives multiply), and the
  paths through the rest of the alternative that read nothing.

The parser follows llama-grammar.cpp's ``parse_sequence`` (same syntax, same expansion of
``*``, ``+``, ``?`` and ``{m,n}``, same limits), so the counts are the ones llama.cpp would
reach. Counting is iterative, and it stops as soon as a count passes its bound.
"""

from __future__ import annotations

from dataclasses import dataclass

REPETITION_THRESHOLD = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD
_SATURATE = 1 << 62  # fan-out counts saturate here (exponential grammars)

Item = tuple[bool, int]  # (is a rule reference, rule id or the elements of a terminal)
Alternative = list[Item]


class GbnfError(ValueError):
    """Text llama.cpp would refuse to parse."""


class GbnfTooLarge(GbnfError):
    """Rules or elements past their bound (counting stopped there)."""


@dataclass(frozen=True, slots=True)
class Shape:
    rules: int  # rules after groups and repetitions are expanded
    elements: int  # grammar elements llama.cpp will store, over all rules
    chain: int  # the longest run of rules each beginning with the next
    fanout: int  # the most parse stacks one step can open (saturating)


def _word(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c == "-")


class _Parser:
    def __init__(self, text: str, max_rules: int, max_elements: int) -> None:
        self.s = text
        self.max_rules = max_rules
        self.max_elements = max_elements
        self.ids: dict[str, int] = {}
        self.rules: dict[int, list[Alternative]] = {}
        self.items = 0  # what this parser holds: bounded like the elements it stands for
        self.n_symbols = 0

    # ------------------------------------------------------------------ characters

    def at(self, pos: int) -> str:
        return self.s[pos] if pos < len(self.s) else ""

    def space(self, pos: int, newline_ok: bool) -> int:
        s, n = self.s, len(self.s)
        while pos < n and (s[pos] in " \t#" or (newline_ok and s[pos] in "\r\n")):
            if s[pos] == "#":
                while pos < n and s[pos] not in "\r\n":
                    pos += 1
            else:
                pos += 1
        return pos

    def name(self, pos: int) -> int:
        end = pos
        while _word(self.at(end)):
            end += 1
        if end == pos:
            raise GbnfError(f"expecting a name at offset {pos}")
        return end

    def digits(self, pos: int) -> int:
        end = pos
        while self.at(end).isascii() and self.at(end).isdigit():
            end += 1
        if end == pos:
            raise GbnfError(f"expecting an integer at offset {pos}")
        return end

    def char(self, pos: int) -> int:
        """The end of one (possibly escaped) character of a literal or class."""
        c = self.at(pos)
        if c == "\\":
            kind = self.at(pos + 1)
            width = {"x": 2, "u": 4, "U": 8}.get(kind)
            if width is not None:
                hex_digits = self.s[pos + 2 : pos + 2 + width]
                if len(hex_digits) != width or any(
                    h not in "0123456789abcdefABCDEF" for h in hex_digits
                ):
                    raise GbnfError(f"expecting {width} hex digits at offset {pos + 2}")
                return pos + 2 + width
            if kind in ("t", "r", "n", "\\", '"', "[", "]", "-"):
                return pos + 2
            raise GbnfError(f"unknown escape at offset {pos}")
        if not c:
            raise GbnfError("unexpected end of input")
        return pos + 1

    # ------------------------------------------------------------------ symbols and rules

    def symbol(self, name: str) -> int:
        if name not in self.ids:
            self.ids[name] = self.new_symbol()
        return self.ids[name]

    def new_symbol(self) -> int:
        self.n_symbols += 1
        if self.n_symbols > self.max_rules:
            raise GbnfTooLarge(
                f"more than {self.max_rules} rules once groups and repetitions are expanded"
            )
        return self.n_symbols - 1

    def grow(self, items: int) -> None:
        """Count items about to be held (each stands for one element or more)."""
        self.items += items
        if self.items > self.max_elements:
            raise GbnfTooLarge(f"more than {self.max_elements} grammar elements once expanded")

    def add_rule(self, rule_id: int, alternatives: list[Alternative]) -> None:
        self.rules[rule_id] = alternatives  # a second definition replaces the first

    # ------------------------------------------------------------------ grammar

    def parse(self) -> None:
        pos = self.space(0, True)
        while pos < len(self.s):
            pos = self.rule(pos)
        for alternatives in self.rules.values():
            for alt in alternatives:
                for is_ref, value in alt:
                    if is_ref and value not in self.rules:
                        raise GbnfError("a rule is referenced but never defined")
        undefined = set(self.ids.values()) - self.rules.keys()
        if undefined:
            raise GbnfError("a rule is referenced but never defined")

    def rule(self, pos: int) -> int:
        end = self.name(pos)
        rule_id = self.symbol(self.s[pos:end])
        pos = self.space(end, False)
        if self.s[pos : pos + 3] != "::=":
            raise GbnfError(f"expecting ::= at offset {pos}")
        pos = self.alternates(self.space(pos + 3, True), rule_id, nested=False)
        if self.at(pos) == "\r":
            pos += 2 if self.at(pos + 1) == "\n" else 1
        elif self.at(pos) == "\n":
            pos += 1
        elif pos < len(self.s):
            raise GbnfError(f"expecting newline or end at offset {pos}")
        return self.space(pos, True)

    def alternates(self, pos: int, rule_id: int, nested: bool) -> int:
        alternatives: list[Alternative] = [[]]
        pos = self.sequence(pos, alternatives[-1], nested)
        while self.at(pos) == "|":
            alternatives.append([])
            pos = self.sequence(self.space(pos + 1, True), alternatives[-1], nested)
        self.add_rule(rule_id, alternatives)
        return pos

    def sequence(self, pos: int, alt: Alternative, nested: bool) -> int:
        last = len(alt)  # where the last symbol starts (a repetition applies to it)
        n_prev_rules = 1
        while pos < len(self.s):
            c = self.s[pos]
            if c == '"':
                pos += 1
                last, n_prev_rules = len(alt), 1
                chars = 0
                while self.at(pos) != '"':
                    pos = self.char(pos)
                    chars += 1
                self.terminal(alt, chars)  # "" is nothing at all
                pos = self.space(pos + 1, nested)
            elif c == "[":
                pos += 1
                if self.at(pos) == "^":
                    pos += 1
                last, n_prev_rules = len(alt), 1
                chars = 0
                while self.at(pos) != "]":
                    pos = self.char(pos)
                    chars += 1
                    if self.at(pos) == "-" and self.at(pos + 1) != "]":
                        pos = self.char(pos + 1)
                        chars += 1
                self.terminal(alt, chars)  # so is []
                pos = self.space(pos + 1, nested)
            elif c in "<!":
                pos = self.token(pos + 1 if c == "!" else pos)
                last, n_prev_rules = len(alt), 1
                self.terminal(alt, 1)
                pos = self.space(pos, nested)
            elif _word(c):
                end = self.name(pos)
                ref = self.symbol(self.s[pos:end])
                pos = self.space(end, nested)
                last, n_prev_rules = len(alt), 1
                self.grow(1)
                alt.append((True, ref))
            elif c == "(":
                before = self.n_symbols
                sub = self.new_symbol()
                pos = self.alternates(self.space(pos + 1, True), sub, nested=True)
                n_prev_rules = max(1, self.n_symbols - before)
                last = len(alt)
                self.grow(1)
                alt.append((True, sub))
                if self.at(pos) != ")":
                    raise GbnfError(f"expecting ')' at offset {pos}")
                pos = self.space(pos + 1, nested)
            elif c == ".":
                last, n_prev_rules = len(alt), 1
                self.terminal(alt, 1)
                pos = self.space(pos + 1, nested)
            elif c in "*+?":
                pos = self.space(pos + 1, nested)
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                n_prev_rules = self.repeat(alt, last, n_prev_rules, lo, hi, pos)
            elif c == "{":
                pos, lo, hi = self.braces(pos, nested)
                n_prev_rules = self.repeat(alt, last, n_prev_rules, lo, hi, pos)
            else:
                break
        return pos

    def terminal(self, alt: Alternative, elements: int) -> None:
        """One item for a literal, class, token or ``.`` of ``elements`` elements."""
        if elements:
            self.grow(1)
            alt.append((False, elements))

    def token(self, pos: int) -> int:
        if self.at(pos) != "<":
            raise GbnfError(f"expecting '<' at offset {pos}")
        pos += 1
        if self.at(pos) == "[":
            end = self.digits(pos + 1)
            if int(self.s[pos + 1 : end]) > 0xFFFFFFFF:
                raise GbnfError(f"token id too big at offset {pos + 1}")
            if self.s[end : end + 2] != "]>":
                raise GbnfError(f"expecting ']>' at offset {end}")
            return end + 2
        end = self.s.find(">", pos)
        if end < 0:
            raise GbnfError(f"expecting '>' after offset {pos}")
        return end + 1

    def braces(self, pos: int, nested: bool) -> tuple[int, int, int | None]:
        pos = self.space(pos + 1, nested)
        end = self.digits(pos)
        lo = int(self.s[pos:end])
        pos = self.space(end, nested)
        hi: int | None
        if self.at(pos) == "}":
            hi = lo
        elif self.at(pos) == ",":
            pos = self.space(pos + 1, nested)
            hi = None
            if self.at(pos).isascii() and self.at(pos).isdigit():
                end = self.digits(pos)
                hi = int(self.s[pos:end])
                pos = self.space(end, nested)
            if self.at(pos) != "}":
                raise GbnfError(f"expecting '}}' at offset {pos}")
        else:
            raise GbnfError(f"expecting ',' at offset {pos}")
        if lo > REPETITION_THRESHOLD:
            raise GbnfError(f"a repetition of more than {REPETITION_THRESHOLD}")
        if hi is not None and hi < lo:
            raise GbnfError(f"a repetition whose maximum {hi} is below its minimum {lo}")
        if hi is not None and hi > REPETITION_THRESHOLD:
            hi = None  # llama.cpp reads a larger maximum as none
        return self.space(pos + 1, nested), lo, hi

    def repeat(
        self, alt: Alternative, last: int, n_prev_rules: int, lo: int, hi: int | None, pos: int
    ) -> int:
        """llama.cpp's rewrite of ``S{lo,hi}`` in place: S lo times, then hi - lo nested
        optional rules (``S'(x) ::= S S'(x-1) |``), or one looping rule when unbounded."""
        if last == len(alt):
            raise GbnfError(f"expecting an item before the repetition at offset {pos}")
        prev = alt[last:]
        total = hi if hi is not None and hi > 0 else (lo if lo > 0 else 1)
        if n_prev_rules * total > REPETITION_THRESHOLD:
            raise GbnfError("a repetition of too many rules")
        if lo == 0:
            del alt[last:]
        else:
            self.grow(len(prev) * (lo - 1))
            alt.extend(prev * (lo - 1))
        n_opt = 1 if hi is None else hi - lo
        previous = 0
        for i in range(n_opt):
            rule_id = self.new_symbol()
            self.grow(len(prev) + 1)
            body = list(prev)
            if i > 0 or hi is None:
                body.append((True, rule_id if hi is None else previous))
            self.add_rule(rule_id, [body, []])
            previous = rule_id
        if n_opt > 0:
            alt.append((True, previous))
        return n_prev_rules * total


def _size(alternatives: list[Alternative]) -> int:
    """Elements llama.cpp stores for these alternatives (one ALT or END after each)."""
    return sum(sum(1 if is_ref else v for is_ref, v in alt) + 1 for alt in alternatives)


def _starts(rules: dict[int, list[Alternative]]) -> tuple[dict[int, tuple[int, int]], int]:
    """For every rule, (stacks opened by entering it, paths through it that read nothing),
    computed without recursion; and the longest chain of rules entered one from the start
    of another. A rule reached again while its own start is being worked out can begin
    with itself: llama.cpp refuses such left recursion, and so does this."""
    done: dict[int, tuple[int, int]] = {}
    depth: dict[int, int] = {}  # the longest chain that starts with the rule
    for root in rules:
        if root in done:
            continue
        # frame: [rule, alternative index, item index, stacks so far, empty paths so far,
        #         this alternative's stacks, this alternative's empty paths, deepest entry]
        frames = [[root, 0, 0, 0, 0, 0, 1, 0]]
        busy = {root}
        while frames:
            f = frames[-1]
            rule_id, a, i = f[0], f[1], f[2]
            alts = rules[rule_id]
            if a == len(alts):
                frames.pop()
                busy.discard(rule_id)
                done[rule_id] = (f[3], f[4])
                depth[rule_id] = f[7] + 1
                continue
            alt = alts[a]
            if i == len(alt) or f[6] == 0:  # the alternative is read (or cannot be empty)
                f[3] = min(f[3] + f[5], _SATURATE)
                f[4] = min(f[4] + f[6], _SATURATE)
                f[1], f[2], f[5], f[6] = a + 1, 0, 0, 1
                continue
            is_ref, value = alt[i]
            if is_ref and value not in done:
                if value in busy:
                    raise GbnfError("left recursion: a rule can begin with itself")
                busy.add(value)
                frames.append([value, 0, 0, 0, 0, 0, 1, 0])
                continue
            if is_ref:
                stacks, empty = done[value]
                f[7] = max(f[7], depth[value])
            else:
                stacks, empty = 1, 0
            f[5] = min(f[5] + f[6] * stacks, _SATURATE)
            f[6] = min(f[6] * empty, _SATURATE)
            f[2] = i + 1
    return done, max(depth.values(), default=0)


def shape(text: str, max_rules: int, max_elements: int) -> Shape:
    """Rules, elements and fan-out of ``text``; GbnfError when llama.cpp would refuse it,
    or as soon as the rules or elements pass their bound."""
    p = _Parser(text, max_rules, max_elements)
    p.parse()
    elements = sum(_size(alternatives) for alternatives in p.rules.values())
    if elements > max_elements:
        raise GbnfTooLarge(f"more than {max_elements} grammar elements once expanded")
    starts, chain = _starts(p.rules)
    fanout = max((sum(v) for v in starts.values()), default=0)  # entering any rule
    for alternatives in p.rules.values():
        for alt in alternatives:
            # from each point of the alternative to its end, backwards
            stacks, empty = 0, 1
            for is_ref, value in reversed(alt):
                s, e = starts[value] if is_ref else (1, 0)
                stacks = min(s + e * stacks, _SATURATE)
                empty = min(e * empty, _SATURATE)
                fanout = max(fanout, stacks + empty)
    return Shape(rules=p.n_symbols, elements=elements, chain=chain, fanout=fanout)
