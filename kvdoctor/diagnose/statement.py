"""Compare a statement quoted in a log with a known crash site's statement, structurally.

A release renames variables and re-wraps lines; an operator pastes one line of a
multi-line `assert`. So a statement is compared as tokens, not text: attribute
chains count by their last name (`group_config.x` is `x`), identifiers become
`N` for the statement's shape, and the words of the identifiers (split at `_`,
plural `s` dropped) say whether two shapes talk about the same things. Nothing
here parses with `eval`; a fragment that Python cannot parse is still tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from difflib import SequenceMatcher

_TOKEN = re.compile(
    r"""(?P<str>[rbfuRBFU]{0,2}(?:'(?:[^'\\\n]|\\.)*'?|"(?:[^"\\\n]|\\.)*"?))"""
    r"""|(?P<name>[A-Za-z_]\w*)|(?P<num>\d[\w.]*)"""
    r"""|(?P<op>==|!=|<=|>=|//|\*\*|->|:=|[-+*/%<>()\[\]{}.,:~&|^@!=])""")
# Words that are the statement's structure, not its subject: they stay themselves in the shape.
STRUCTURAL = frozenset({"assert", "not", "and", "or", "in", "is", "None", "True", "False", "if", "else", "len",
                        "isinstance", "any", "all", "sum", "min", "max", "set", "list", "tuple", "dict", "for"})
_IGNORED_WORDS = frozenset({"self", ""})
SHAPE_RATIO = 0.75  # two shapes this alike (difflib ratio) can be one statement re-worded...
WORD_OVERLAP = 0.5  # ...when the words of their identifiers overlap this much (Jaccard)


@dataclass(frozen=True)
class Tokens:
    """A statement's condition as tokens: `names` collapsed (last name of a chain), with its message apart."""

    tokens: tuple[str, ...]  # names collapsed, strings as S
    shape: tuple[str, ...]  # names as N, numbers as 0
    message: str  # the assert's message text, if the statement has one
    balanced: bool  # brackets close: a whole statement, not one line of it

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t for t in self.tokens if _is_name(t) and t not in STRUCTURAL)

    @property
    def words(self) -> frozenset[str]:
        return frozenset(w for n in self.names for w in identifier_words(n))

    @property
    def text(self) -> str:
        return " ".join(self.tokens)


def _is_name(token: str) -> bool:
    return bool(token) and (token[0].isalpha() or token[0] == "_")


def identifier_words(name: str) -> list[str]:
    """`num_pending_gpu_blocks` -> num, pending, gpu, block (camelCase split, plural `s` dropped)."""
    parts = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower().split("_")
    return [p[:-1] if len(p) > 3 and p.endswith("s") and not p.endswith("ss") else p
            for p in parts if p not in _IGNORED_WORDS]


def _raw_tokens(text: str) -> list[tuple[str, str]]:
    return [(m.lastgroup or "op", m.group()) for m in _TOKEN.finditer(text)]


def tokenize(text: str) -> Tokens:
    """The condition of `assert COND, MSG` (or any expression or statement line) as `Tokens`."""
    raw = _raw_tokens(text)
    if raw and raw[0] == ("name", "assert"):
        raw = raw[1:]
    depth, balanced, cut = 0, True, None
    for index, (_, value) in enumerate(raw):
        if value in "([{":
            depth += 1
        elif value in ")]}":
            depth -= 1
            if depth < 0:
                balanced = False
                depth = 0
        elif value == "," and depth == 0 and cut is None:
            cut = index
    if depth:
        balanced = False
    message = ""
    if cut is not None:
        message = " ".join(v for kind, v in raw[cut + 1:] if kind == "str")
        raw = raw[:cut]
    while len(raw) >= 2 and raw[0][1] == "(" and raw[-1][1] == ")" and _wraps(raw):
        raw = raw[1:-1]
    collapsed: list[tuple[str, str]] = []
    for kind, value in raw:  # `a.b.c` -> `c`: a chain counts by its last name
        if kind == "name" and len(collapsed) >= 2 and collapsed[-1][1] == "." and collapsed[-2][0] == "name":
            collapsed = collapsed[:-2]
        collapsed.append((kind, value))
    tokens = tuple("S" if kind == "str" else value for kind, value in collapsed)
    shape = tuple("N" if kind == "name" and value not in STRUCTURAL else "0" if kind == "num" else
                  "S" if kind == "str" else value for kind, value in collapsed)
    return Tokens(tokens, shape, message, balanced)


def _wraps(raw: list[tuple[str, str]]) -> bool:
    """The first bracket closes at the last token: `( ... )` around the whole condition."""
    depth = 0
    for index, (_, value) in enumerate(raw):
        depth += value in "([{"
        depth -= value in ")]}"
        if depth == 0:
            return index == len(raw) - 1
    return False


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a | b else 0.0


@dataclass(frozen=True)
class Likeness:
    kind: str  # "exact" | "renamed" | "partial" | "partial-renamed"
    similarity: float


def compare(shown: str, known: str) -> Likeness | None:
    """How the statement `shown` (from a log) relates to the `known` one (a release's crash site).

    exact: the same condition, token for token. renamed: the same shape (nearly) about the same things,
    with other names. partial / partial-renamed: `shown` is one line of the known statement (brackets
    left open, or a piece without `assert`). None: another statement, or too little to say."""
    a, b = tokenize(shown), tokenize(known)
    if not a.names or not b.tokens:
        return None  # `assert (` alone names nothing
    if a.tokens == b.tokens:
        return Likeness("exact", 1.0)
    whole = shown.lstrip().startswith("assert")
    if a.balanced and (whole or len(set(a.names)) >= 2):  # a whole condition, with or without its `assert`
        ratio = SequenceMatcher(None, a.shape, b.shape, autojunk=False).ratio()
        overlap = _jaccard(a.words, b.words)
        if ratio >= SHAPE_RATIO and overlap >= WORD_OVERLAP:
            return Likeness("renamed", round((ratio + overlap) / 2, 2))
        if whole:
            return None
    # one line of a multi-line statement: a contiguous run of the known tokens, or of their shape
    n = len(a.tokens)
    if n > len(b.tokens):
        return None
    for start in range(len(b.tokens) - n + 1):
        if b.tokens[start:start + n] == a.tokens:
            return Likeness("partial", 1.0)
    best = 0.0
    if len(set(a.names)) < 2:
        return None  # one renamed name alone says too little
    for start in range(len(b.shape) - n + 1):
        if b.shape[start:start + n] != a.shape:
            continue
        window = Tokens(b.tokens[start:start + n], b.shape[start:start + n], "", True)
        best = max(best, _jaccard(a.words, window.words))
    return Likeness("partial-renamed", round(best, 2)) if best >= WORD_OVERLAP else None


def is_fragment(text: str) -> bool:
    """One line of a multi-line statement: its brackets do not balance, or it is not a whole statement."""
    stripped = text.strip()
    return not tokenize(stripped).balanced or not re.match(r"(assert|raise|return|if|for|while)\b|\w+\s*=[^=]",
                                                           stripped)


def message_pattern(parts: list[str | None]) -> str:
    """A regex for a message built from literal parts and formatted values (None): `Block {key!r} not found`."""
    out = []
    for part in parts:
        out.append(".{0,400}?" if part is None else re.escape(part))
    return "".join(out)


def message_matches(pattern: str, message: str) -> bool:
    if not pattern or not message or len(re.sub(r"\.\{0,400\}\?", "", pattern)) < 6:
        return False
    try:
        return re.search(pattern, message) is not None
    except re.error:
        return False
