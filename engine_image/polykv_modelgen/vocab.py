"""Tokenizer and chat template for the generated model: byte-level BPE in llama.cpp's "gpt2" form.

Token ids are laid out so the interesting ones never move when the merges change:
ids 0..255 are the 256 single bytes (id == byte value), the special tokens follow at fixed ids,
then one token per learned merge. Merges are trained here, deterministically, on the built-in
corpus (polykv_modelgen.corpus), so ordinary English and code cost far less than a token per char.
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections import Counter
from dataclasses import dataclass
from functools import cache

from polykv_modelgen.corpus import ENGLISH_TEXT, SAMPLES

# llama.cpp token types (gguf.TokenType): NORMAL text tokens and CONTROL special tokens.
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3

BYTE_TOKENS = 256
BOS_ID = 256
EOS_ID = 257
IM_START_ID = 258
IM_END_ID = 259  # end of turn: llama.cpp's EOT, so chat generation stops on it
PAD_ID = 260
SPECIAL_TOKENS = {
    BOS_ID: "<|bos|>",
    EOS_ID: "<|endoftext|>",
    IM_START_ID: "<|im_start|>",
    IM_END_ID: "<|im_end|>",
    PAD_ID: "<|pad|>",
}
FIRST_MERGE_ID = BYTE_TOKENS + len(SPECIAL_TOKENS)

# "qwen2", not "gpt-2": both are byte-level BPE, but llama.cpp enables clean_up_tokenization_spaces
# for "gpt-2", and llama_detokenize would then turn "a ." into "a." (no exact round trip).
# qwen2 is also ChatML's own tokenizer family and has a fast built-in splitter in llama.cpp.
PRE_TOKENIZER = "qwen2"

# llama.cpp's qwen2 split regex restricted to ASCII (the corpus is ASCII), so the merges
# learned here are exactly the ones llama.cpp can apply within its pre-tokens.
_PRE_SPLIT = re.compile(
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    r"|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

MAX_MERGES = 2560
_SAMPLE_WEIGHT = 8  # the samples are short; weight them so their symbols and indents merge


@cache
def byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's reversible byte -> printable character table (byte b is table[b]).

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are
    shifted to 256 + n in byte order, which is how llama.cpp decodes byte-level BPE tokens.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table: list[str] = []
    shifted = 0
    for b in range(256):
        if b in keep:
            table.append(chr(b))
        else:
            table.append(chr(256 + shifted))
            shifted += 1
    return tuple(table)


def encode_bytes(text: str) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def _corpus_counts() -> Counter[str]:
    counts: Counter[str] = Counter()
    words = ENGLISH_TEXT.split()
    n = len(words)
    for rank, word in enumerate(words):
        weight = 1 + (4 * n) // (rank + 8)  # Zipf-like: frequent words merge first
        counts[" " + word] += weight
        counts[" " + word.capitalize()] += max(1, weight // 4)
        counts[word.capitalize()] += max(1, weight // 8)
    for sample in SAMPLES:
        for piece in _PRE_SPLIT.findall(sample):
            counts[piece] += _SAMPLE_WEIGHT
    return counts


def train_merges(counts: Counter[str], max_merges: int) -> list[tuple[str, str]]:
    """Classic BPE training: repeatedly merge the most frequent adjacent pair.

    Pair counts are updated incrementally (only words containing the merged pair change) and
    the best pair comes from a lazy max-heap; ties break on the pair's text, so the result
    depends only on the corpus.
    """
    words = [[*encode_bytes(w)] for w in counts]
    freqs = list(counts.values())
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for i, syms in enumerate(words):
        for pair in itertools.pairwise(syms):
            pair_counts[pair] += freqs[i]
            where.setdefault(pair, set()).add(i)
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while heap and len(merges) < max_merges:
        neg, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg:
            continue  # stale heap entry
        if -neg < 2:
            break  # a pair seen once is noise, not a useful token
        merges.append(pair)
        joined = pair[0] + pair[1]
        touched: set[tuple[str, str]] = set()
        for i in sorted(where.pop(pair, set())):
            old = words[i]
            for p in itertools.pairwise(old):
                pair_counts[p] -= freqs[i]
                touched.add(p)
            new: list[str] = []
            j = 0
            while j < len(old):
                if j + 1 < len(old) and (old[j], old[j + 1]) == pair:
                    new.append(joined)
                    j += 2
                else:
                    new.append(old[j])
                    j += 1
            words[i] = new
            for p in itertools.pairwise(new):
                pair_counts[p] += freqs[i]
                where.setdefault(p, set()).add(i)
                touched.add(p)
        pair_counts.pop(pair, None)
        for p in sorted(touched):
            c = pair_counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            elif p != pair:
                pair_counts.pop(p, None)
    return merges


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # "left right", in rank order


@cache
def build_vocab(max_merges: int = MAX_MERGES) -> Vocab:
    table = byte_to_unicode()
    tokens = list(table)
    types = [TOKEN_NORMAL] * BYTE_TOKENS
    for tid, text in SPECIAL_TOKENS.items():
        assert tid == len(tokens)
        tokens.append(text)
        types.append(TOKEN_CONTROL)
    seen = set(tokens)
    merges: list[str] = []
    for left, right in train_merges(_corpus_counts(), max_merges):
        merges.append(f"{left} {right}")
        # Two merges can spell the same string ("a bc", "ab c"): one token serves both.
        if left + right not in seen:
            seen.add(left + right)
            tokens.append(left + right)
            types.append(TOKEN_NORMAL)
    return Vocab(tokens=tokens, token_types=types, merges=merges)


def quiet_token_ids() -> list[int]:
    """Ids whose output logit is pinned to 0, so greedy decoding never picks them.

    Control tokens (a random model would otherwise stop at an arbitrary point) and single
    bytes that are not printable ASCII or whitespace (alone they are invalid or unprintable
    UTF-8). Every other token is ASCII text, so greedy generations are always clean text.
    """
    text_bytes = {9, 10, *range(0x20, 0x7F)}
    return [b for b in range(BYTE_TOKENS) if b not in text_bytes] + list(SPECIAL_TOKENS)


# ChatML. System text (first message) and an optional tool list share the system block;
# assistant tool calls and tool results use <tool_call>/<tool_response> tags with JSON inside.
# Content may be a string, null, or a list of OpenAI {"type": "text"} parts. Every tag uses
# "-" whitespace control, so trim_blocks/lstrip_blocks settings do not change the output.
CHAT_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is string -%}{{- c -}}"
    "{%- elif c is iterable and c is not mapping -%}"
    "{%- for p in c -%}{%- if p.type == 'text' -%}{{- p.text -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(sys=none, start=0) -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set ns.sys = text(messages[0].content) -%}{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if ns.sys -%}{{- ns.sys ~ '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nThese functions are available; their JSON schemas are listed between "
    "<tools> and </tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' ~ (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, reply with a JSON object naming it and giving its "
    'arguments, wrapped in tags:\\n<tool_call>\\n{"name": "...", "arguments": {...}}\\n'
    "</tool_call><|im_end|>\\n' -}}"
    "{%- elif ns.sys is not none -%}"
    "{{- '<|im_start|>system\\n' ~ ns.sys ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages[ns.start:] -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set body = text(m.content) -%}"
    "{{- '<|im_start|>assistant\\n' ~ body -}}"
    "{%- for tc in (m.tool_calls or []) -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- if body or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' ~ f.name ~ \'", "arguments": \' -}}'
    "{{- f.arguments if f.arguments is string else (f.arguments | tojson) -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' ~ text(m.content) "
    "~ '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' ~ m.role ~ '\\n' ~ text(m.content) ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
