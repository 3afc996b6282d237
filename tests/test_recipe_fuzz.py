"""Fuzz the recipe loader: whatever the bytes, it returns a Recipe or raises a one-line RecipeError.

The error must start with the source name and `:<line>:` (a line inside the
document). Any other exception is a loader bug. Pure Python, a few seconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvdoctor.errors import RecipeError
from kvdoctor.recipes.loader import load_recipe_file, load_recipe_text
from kvdoctor.recipes.model import Recipe
from kvdoctor.steps import REGISTRY

REPO = Path(__file__).resolve().parent.parent
QUEUED_ABORT = (REPO / "repros" / "queued-abort.toml").read_text(encoding="utf-8")
BASE_LINES = QUEUED_ABORT.split("\n")

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Structured documents cost more to generate; fewer of them keep the whole file at a few seconds.
FUZZ_STRUCTURED = settings(FUZZ, max_examples=150)

# -- what a valid recipe is made of --------------------------------------------------

SETUP_KEYS = ["block_size", "blocks_per_chunk", "gpu_blocks", "async_scheduling", "max_num_seqs",
              "max_num_batched_tokens", "max_model_len", "enable_chunked_prefill", "offload_prompt_only",
              "cpu_bytes_to_use", "spec_name", "kv_connector_extra_config", "model"]
ACTIONS = tuple(REGISTRY)  # the step kinds, in declaration order
FIELD_KEYS = sorted({key for kind in REGISTRY.values() for key in kind.fields})
TABLE_KEYS = {
    "recipe": ["name", "summary", "bug", "title", "refs", "requires", "invariants"],
    "setup": SETUP_KEYS,
    "signature": ["exception", "function", "contains", "invariant"],
    "step": ["action", *FIELD_KEYS],
    "check": FIELD_KEYS,
}
REQUESTS = ["A", "B", "C"]

bare_keys = st.text("abcdefghijklmnopqrstuvwxyz_-0123456789ABCZ", min_size=1, max_size=12)
junk_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)


def toml_string(s: str) -> str:
    """`s` as a TOML basic string (escapes for quotes, backslashes and control characters)."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


scalar_values = st.one_of(
    st.integers(-3, 40).map(str),
    st.integers().map(str),
    st.sampled_from(["true", "false", "0", "-1", "1.5", "inf", "nan", "1e3", "0x1F", "0o7", "0b11", "1_000",
                     "1979-05-27", "07:32:00", "1979-05-27T07:32:00Z"]),
    st.sampled_from(REQUESTS + list(ACTIONS) + ["store", "load", "present", "released", "WAITING",
                                                "RUNNING", "FINISHED_ABORTED", "waiting", ""]).map(toml_string),
    junk_text.map(toml_string),
    st.just("'literal'"),
    st.just('"""\nmulti\n[[step]]\nline\n"""'),
)
values = st.recursive(
    scalar_values,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.lists(st.tuples(bare_keys, inner), max_size=3).map(
            lambda kvs: "{" + ", ".join(f"{k} = {v}" for k, v in dict(kvs).items()) + "}"),
    ),
    max_leaves=4,
)


def rarely(draw, n: int) -> bool:
    """True about once in `n` draws (a middle value: hypothesis favours the ends of a range)."""
    return draw(st.integers(0, n - 1)) == n // 2


# Values a key is likely to accept, so that documents get past type checks into deeper rules.
LIKELY = {
    "action": st.sampled_from(ACTIONS).map(toml_string),
    "request": st.sampled_from(REQUESTS).map(toml_string),
    "shared_prefix_with": st.sampled_from(REQUESTS).map(toml_string),
    "kind": st.sampled_from(["store", "load", "stor"]).map(toml_string),
    "status": st.sampled_from(['"WAITING"', '"RUNNING"', '["WAITING", "PREEMPTED"]', '"waiting"', "[]"]),
    "connector_state": st.sampled_from(['"present"', '"released"', '"gone"']),
    "fill_pool": st.sampled_from(["true", "false"]),
    "prompt": st.sampled_from(["[1, 2, 3]", "[]", "[1024]", "[-1]", '["a"]']),
    "refs": st.sampled_from(['["a", "b"]', "[1]", "[]"]),
    "requires": st.sampled_from(['["spec:CPUOffloadingSpec"]', '["kv_cache_group_field:x"]', '["spec:"]', '["x"]',
                                 "[]"]),
    "invariants": st.sampled_from(['["no-orphan-transfer-jobs"]', '["store-covers-computed-slots"]', '["nope"]', "[]"]),
    "invariant": st.sampled_from(['"no-orphan-transfer-jobs"', '"store-covers-computed-slots"', '"nope"']),
    "kv_connector_extra_config": st.sampled_from(["{}", '{a = "b"}', "3"]),
    "async_scheduling": st.sampled_from(["true", "false"]),
    "enable_chunked_prefill": st.sampled_from(["true", "false"]),
    "offload_prompt_only": st.sampled_from(["true", "false"]),
}
for _key in ("name", "summary", "bug", "title", "exception", "function", "contains",
             "spec_name", "description"):
    LIKELY[_key] = junk_text.map(toml_string)
ODD_KEYS = st.sampled_from(['"quoted key"', "dotted.key", '"a\\nb"', "kv_connector_extra_config.x", "'lit'"])


@st.composite
def key_lines(draw, table: str) -> str:
    """One `key = value` line for `table`: mostly its own keys with plausible values, sometimes junk."""
    pick = draw(st.integers(0, 39))
    key = draw(bare_keys if pick == 7 else ODD_KEYS if pick == 8 else st.sampled_from(TABLE_KEYS.get(table, ["x"])))
    likely = LIKELY.get(key, st.integers(-2, 40).map(str))
    return f"{key} = {draw(values if rarely(draw, 6) else likely)}"


JUNK_LINES = st.one_of(
    st.sampled_from(["", "# comment", "[", "]]", "=", "key =", "= 1", "[[]]", "[a..b]", '"""', "a = [1,",
                     "[step]", "[[recipe]]", "a = 1 b = 2", "[recipe]", "[[step]]"]),
    junk_text,
)


@st.composite
def table_body(draw, table: str) -> list[str]:
    """The lines of one table: distinct keys (repeats are only TOML errors), rarely a junk line."""
    lines: list[str] = []
    seen: set[str] = {"name", "summary"} if table == "recipe" else set()
    if table == "signature" and not rarely(draw, 5):
        lines += ['exception = "AssertionError"', 'function = "_build_store_jobs"']
        seen.update(("exception", "function"))
    if table == "step" and not rarely(draw, 6):
        lines.append(f"action = {draw(LIKELY['action'])}")
        seen.add("action")
    for _ in range(draw(st.integers(0, 4))):
        if rarely(draw, 40):
            lines.append(draw(JUNK_LINES))
            continue
        line = draw(key_lines(table))
        key = line.split(" = ", 1)[0]
        if key not in seen:
            seen.add(key)
            lines.append(line)
    return lines


@st.composite
def toml_documents(draw) -> str:
    """Random TOML text shaped like a recipe: its tables in a plausible order, salted with junk."""
    lines: list[str] = []
    if not rarely(draw, 10):
        lines += ["[recipe]", f"name = {draw(LIKELY['name'])}", 'summary = "s"', *draw(table_body("recipe"))]
    if draw(st.booleans()):
        lines += ["[setup]", *draw(table_body("setup"))]
        if rarely(draw, 6):
            lines += ["[setup.kv_connector_extra_config]", *draw(table_body("x"))]
    if not rarely(draw, 10):
        lines += ["[signature]", *draw(table_body("signature"))]
    for _ in range(0 if rarely(draw, 20) else draw(st.integers(1, 7))):
        lines += ["[[step]]", *draw(table_body("step"))]
    for _ in range(draw(st.integers(0, 2))):
        lines += ["[[check]]", *draw(table_body("check"))]
    if rarely(draw, 10):
        table = draw(st.sampled_from(["junk", "recipe", "step.sub", "steps", "setup"]))
        where = draw(st.integers(0, len(lines)))
        lines[where:where] = [f"[[{table}]]" if "step" in table else f"[{table}]", *draw(table_body(table))]
    return "\n".join(lines) + draw(st.sampled_from(["", "\n", "\r\n"]))


@st.composite
def mutated_queued_abort(draw) -> str:
    """queued-abort.toml with lines deleted, duplicated, swapped, replaced or edited."""
    lines = list(BASE_LINES)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "replace", "insert", "value", "key", "truncate"]))
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        if not lines:
            lines.append(draw(key_lines("step")))
        elif op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "replace":
            lines[i] = draw(st.one_of(key_lines("step"), junk_text))
        elif op == "insert":
            lines.insert(i, draw(st.one_of(key_lines("step"), key_lines("setup"), junk_text,
                                           st.sampled_from(["[[step]]", "[[check]]", "[setup]", "[x]"]))))
        elif op == "value" and "=" in lines[i]:
            lines[i] = lines[i].split("=", 1)[0] + "= " + draw(values)
        elif op == "key" and "=" in lines[i]:
            lines[i] = draw(st.one_of(bare_keys, st.sampled_from(FIELD_KEYS))) + " =" + lines[i].split("=", 1)[1]
        elif op == "truncate":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
    return "\n".join(lines)


# -- the property ----------------------------------------------------------------------


def check_outcome(load, source: str, text: str | None) -> None:
    """`load()` returns a Recipe or raises a RecipeError `source:<line>: ...` on one line."""
    try:
        recipe = load()
    except RecipeError as exc:
        message = str(exc)
        assert "\n" not in message and "\r" not in message, repr(message)
        match = re.match(re.escape(source) + r":(\d+): \S", message)
        assert match, repr(message)
        line = int(match.group(1))
        assert line >= 1, message
        if text is not None:
            assert line <= text.count("\n") + 1, (message, text.count("\n") + 1)
        return
    assert isinstance(recipe, Recipe)
    assert recipe.steps
    if text is not None:
        lines = text.split("\n")
        for step in recipe.steps + recipe.checks:
            assert 1 <= step.line <= len(lines), step
            # A step's line is its `[[step]]` header (or the `step = [...]` key of an inline array).
            table = "check" if step in recipe.checks else "step"
            assert table in lines[step.line - 1], (step, lines[step.line - 1])


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_through_load_recipe_file(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "fuzz.toml"
    path.write_bytes(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    check_outcome(lambda: load_recipe_file(path), str(path), text)


# Inputs that once escaped as other exceptions or as multi-line messages: always tried.
NASTY = [
    "x = " + "9" * 5000,  # int() refuses it with ValueError
    "x = " + "[" * 3000 + "]" * 3000,  # tomllib recursion
    "x = " + "{a = " * 1500 + "1" + "}" * 1500,
    QUEUED_ABORT.replace('request = "B"', 'request = "B\\nC"'),  # a request id with a newline
    QUEUED_ABORT.replace("gpu_blocks = 8", '"gpu\\nblocks" = 8'),  # a key with a newline
    QUEUED_ABORT.replace("# K1,", "# K1 \u2028\u2029\x85,").replace("gpu_blocks = 8", "gpu_blocks = 0"),
    QUEUED_ABORT.replace("Request A fills", "[[step]]\n[setup]\nRequest A fills"),
    "\ufeff" + QUEUED_ABORT,
    "[recipe]\n" * 3,
    "[",
    "",
]


@FUZZ
@given(st.text(max_size=300))
@example(NASTY[0]).via("fixed")
@example(NASTY[1]).via("fixed")
@example(NASTY[2]).via("fixed")
@example(NASTY[3]).via("fixed")
@example(NASTY[4]).via("fixed")
@example(NASTY[5]).via("fixed")
@example(NASTY[6]).via("fixed")
@example(NASTY[7]).via("fixed")
@example(NASTY[8]).via("fixed")
@example(NASTY[9]).via("fixed")
@example(NASTY[10]).via("fixed")
def test_random_text(text: str) -> None:
    check_outcome(lambda: load_recipe_text(text, "fuzz.toml"), "fuzz.toml", text)


@FUZZ_STRUCTURED
@given(toml_documents())
def test_random_toml_documents(text: str) -> None:
    check_outcome(lambda: load_recipe_text(text, "doc.toml"), "doc.toml", text)


@FUZZ_STRUCTURED
@given(mutated_queued_abort())
def test_mutated_queued_abort(text: str) -> None:
    check_outcome(lambda: load_recipe_text(text, "queued-abort.toml"), "queued-abort.toml", text)


@FUZZ_STRUCTURED
@given(mutated_queued_abort())
def test_mutated_queued_abort_as_file(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("mut") / "queued-abort.toml"
    path.write_bytes(text.encode("utf-8"))
    check_outcome(lambda: load_recipe_file(path), str(path), text)


def test_the_unmutated_base_loads() -> None:
    check_outcome(lambda: load_recipe_text(QUEUED_ABORT, "queued-abort.toml"), "queued-abort.toml", QUEUED_ABORT)
