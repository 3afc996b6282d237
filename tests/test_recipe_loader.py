"""The recipe loader: every malformed file is one RecipeError naming file:line and what was expected.

Pure Python: nothing here imports vLLM (and the loader must not either).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvdoctor.errors import EXIT_USAGE, RecipeError
from kvdoctor.recipes.builtins import builtin_dir, builtin_names, load_builtin
from kvdoctor.recipes.loader import load_recipe_file, load_recipe_text
from kvdoctor.recipes.model import Recipe

REPO = Path(__file__).resolve().parent.parent

# A small valid recipe; the tests break one thing at a time.
GOOD = textwrap.dedent('''\
    # a comment
    [recipe]
    name = "mini"
    summary = """
    Two requests; B is aborted while queued.
    """
    refs = ["vllm#1"]

    [setup]
    block_size = 4
    gpu_blocks = 8

    [signature]
    exception = "AssertionError"
    function = "_build_store_jobs"

    [[step]]
    action = "add"
    request = "A"
    fill_pool = true
    max_tokens = 8

    [[step]]
    action = "schedule"

    [[step]]
    action = "add"
    request = "B"
    prompt_chunks = 4

    [[step]]
    action = "schedule"
    count = 2

    [[step]]
    action = "expect"
    request = "B"
    status = "WAITING"
    allocated_blocks = 0

    [[step]]
    action = "abort"
    request = "B"

    [[check]]
    request = "B"
    store_jobs_built = 0
''')


def write(tmp_path: Path, text: str | bytes, name: str = "recipe.toml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def line_of(text: str, needle: str, occurrence: int = 1) -> int:
    """1-based line of the `occurrence`-th line containing `needle`."""
    hits = [n for n, line in enumerate(text.split("\n"), start=1) if needle in line]
    assert len(hits) >= occurrence, f"{needle!r} not in the test recipe"
    return hits[occurrence - 1]


def replace(text: str, old: str, new: str, count: int = 1) -> str:
    assert old in text, old
    return text.replace(old, new, count)


def load_error(path: Path) -> str:
    """Load a broken file; return its one-line message after checking the file:line prefix."""
    with pytest.raises(RecipeError) as info:
        load_recipe_file(path)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, message
    assert message.startswith(f"{path}:"), message
    assert info.value.exit_code == EXIT_USAGE == 2
    return message


def assert_error(tmp_path: Path, text: str | bytes, line: int, *words: str) -> str:
    path = write(tmp_path, text)
    message = load_error(path)
    assert message.startswith(f"{path}:{line}: "), message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


# -- the good recipe and the built-ins load --------------------------------------


def test_good_recipe_loads(tmp_path: Path) -> None:
    recipe = load_recipe_file(write(tmp_path, GOOD))
    assert isinstance(recipe, Recipe)
    assert recipe.name == "mini"
    assert recipe.summary == "Two requests; B is aborted while queued."
    assert recipe.setup == {"block_size": 4, "gpu_blocks": 8}
    assert recipe.signature.exception == "AssertionError"
    assert [s.action for s in recipe.steps] == ["add", "schedule", "add", "schedule", "expect", "abort"]
    assert [s.line for s in recipe.steps] == [line_of(GOOD, "[[step]]", k) for k in range(1, 7)]
    assert recipe.steps[3].args == {"count": 2}
    assert recipe.checks[0].action == "expect" and recipe.checks[0].line == line_of(GOOD, "[[check]]")
    assert recipe.refs == ("vllm#1",)
    assert recipe.source == str(tmp_path / "recipe.toml") and not recipe.builtin


def test_every_builtin_recipe_loads() -> None:
    names = builtin_names()
    assert "queued-abort" in names
    for name in names:
        recipe = load_builtin(name)
        assert recipe.builtin and recipe.name == name, name
        assert recipe.steps, name
        lines = (builtin_dir() / f"{name}.toml").read_text(encoding="utf-8").split("\n")
        # Step and check lines point at their table headers (what timelines and errors show).
        for step in recipe.steps:
            assert lines[step.line - 1].strip().startswith("[[step]]"), (name, step)
        for check in recipe.checks:
            assert lines[check.line - 1].strip().startswith("[[check]]"), (name, check)


@pytest.mark.parametrize("path", sorted((REPO / "repros").glob("*.toml")), ids=lambda p: p.name)
def test_every_repros_file_loads(path: Path) -> None:
    recipe = load_recipe_file(path)
    assert recipe.name == path.stem


def test_queued_abort_contents() -> None:
    recipe = load_builtin("queued-abort")
    assert recipe.bug == "K1"
    assert recipe.signature.function == "_build_store_jobs"
    assert recipe.signature.contains == "len(offload_keys) == len(offload_block_ids)"
    assert [c.args["request"] for c in recipe.checks] == ["B", "B"]


def test_loader_does_not_import_vllm() -> None:
    """In a fresh interpreter where importing vllm or torch fails loudly, every built-in still loads."""
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("vllm", "torch"):
                    raise ImportError("the recipe loader must not import " + name)
        sys.meta_path.insert(0, Block())
        from kvdoctor.recipes.builtins import all_builtins
        from kvdoctor.recipes.loader import load_recipe_file
        assert all_builtins()
        load_recipe_file(sys.argv[1])
        assert "vllm" not in sys.modules and "torch" not in sys.modules
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code, str(REPO / "repros" / "queued-abort.toml")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_loading_in_process_leaves_vllm_unimported(tmp_path: Path) -> None:
    if "vllm" in sys.modules:  # another test of this session ran vLLM; the subprocess test covers it
        pytest.skip("vllm already imported by another test")
    load_recipe_file(write(tmp_path, GOOD))
    load_builtin("queued-abort")
    assert "vllm" not in sys.modules


def test_recipes_are_data_not_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    short = "__import__('os').system('true')"  # a name is one line of at most 100 characters (the loader's cap)
    text = replace(GOOD, 'name = "mini"', f'name = "{short}"')
    text = replace(text, 'request = "B"\nprompt_chunks', f'request = "{payload}"\nprompt_chunks')
    text = text.replace('request = "B"', f'request = "{payload}"')
    recipe = load_recipe_file(write(tmp_path, text))
    assert recipe.name == short
    assert payload in {step.args.get("request") for step in recipe.steps}
    assert not marker.exists()


# -- steps -------------------------------------------------------------------------


def test_unknown_action(tmp_path: Path) -> None:
    text = replace(GOOD, 'action = "abort"', 'action = "abrot"')
    assert_error(tmp_path, text, line_of(text, "abrot"),
                 "step 6", "unknown action 'abrot'", "expected one of add, schedule, drain, abort")


def test_action_not_a_string(tmp_path: Path) -> None:
    text = replace(GOOD, 'action = "abort"', "action = 3")
    assert_error(tmp_path, text, line_of(text, "action = 3"), "step 6", "unknown action 3")


def test_step_without_action(tmp_path: Path) -> None:
    text = replace(GOOD, 'action = "schedule"\ncount = 2', "count = 2")
    assert_error(tmp_path, text, line_of(text, "[[step]]", 4), "step 4 needs 'action'", "one of add")


def test_unknown_request_id(tmp_path: Path) -> None:
    text = replace(GOOD, 'action = "abort"\nrequest = "B"', 'action = "abort"\nrequest = "C"')
    assert_error(tmp_path, text, line_of(text, 'request = "C"'),
                 "step 6 (abort)", "unknown request 'C'", "added so far: A, B")


def test_request_used_before_its_add(tmp_path: Path) -> None:
    text = replace(GOOD, '[[step]]\naction = "schedule"\n\n', '[[step]]\naction = "finish"\nrequest = "B"\n\n')
    assert_error(tmp_path, text, line_of(text, 'request = "B"'),
                 "step 2 (finish)", "request 'B' is used before it is added",
                 f"step 3, line {line_of(text, '[[step]]', 3)}")


def test_unknown_request_in_transfer_step(tmp_path: Path) -> None:
    text = replace(GOOD, 'action = "abort"\nrequest = "B"', 'action = "hold_transfers"\nrequest = "Z"\nkind = "store"')
    assert_error(tmp_path, text, line_of(text, 'request = "Z"'), "step 6 (hold_transfers)", "unknown request 'Z'")


def test_duplicate_request_add(tmp_path: Path) -> None:
    text = replace(GOOD, 'request = "B"\nprompt_chunks', 'request = "A"\nprompt_chunks')
    assert_error(tmp_path, text, line_of(text, 'request = "A"', 2),
                 "step 3 (add)", "request 'A' was already added", f"line {line_of(text, '[[step]]')}")


def test_shared_prefix_with_unknown_request(tmp_path: Path) -> None:
    text = replace(GOOD, "prompt_chunks = 4", 'prompt_chunks = 4\nshared_prefix_with = "Q"\nshared_prefix_tokens = 4')
    assert_error(tmp_path, text, line_of(text, "shared_prefix_with"), "shared_prefix_with", "unknown request 'Q'")


def test_shared_prefix_needs_both_fields(tmp_path: Path) -> None:
    text = replace(GOOD, "prompt_chunks = 4", 'prompt_chunks = 4\nshared_prefix_with = "A"')
    assert_error(tmp_path, text, line_of(text, "[[step]]", 3),
                 "needs both 'shared_prefix_with' and one of 'shared_prefix_tokens' or 'shared_prefix_chunks'")


@pytest.mark.parametrize("old,new,what,expected", [
    ("prompt_chunks = 4", 'prompt_tokens = "16"', "step 3 (add) prompt_tokens", "an integer, got '16'"),
    ("prompt_chunks = 4", "prompt_chunks = 4.0", "step 3 (add) prompt_chunks", "an integer, got 4.0"),
    ("prompt_chunks = 4", "prompt_chunks = true", "step 3 (add) prompt_chunks", "an integer, got True"),
    ("fill_pool = true", "fill_pool = 3", "step 1 (add) fill_pool", "true or false or a string, got 3"),
    ("max_tokens = 8", "max_tokens = [8]", "step 1 (add) max_tokens", "an integer, got [8]"),
    ('request = "A"', "request = 1", "step 1 (add) request", "a string, got 1"),
    ("prompt_chunks = 4", 'prompt = "1 2 3"', "step 3 (add) prompt", "an array, got '1 2 3'"),
    ("count = 2", 'count = "2"', "step 4 (schedule) count", "an integer, got '2'"),
    ('status = "WAITING"', "status = 3", "step 5 (expect) status", "a string or an array, got 3"),
    ("store_jobs_built = 0", "store_jobs_built = 0.5", "check 1 (expect) store_jobs_built", "an integer"),
])
def test_wrong_type_in_step(tmp_path: Path, old: str, new: str, what: str, expected: str) -> None:
    text = replace(GOOD, old, new)
    assert_error(tmp_path, text, line_of(text, new), what, "must be " + expected)


def test_unknown_field_in_step(tmp_path: Path) -> None:
    text = replace(GOOD, "prompt_chunks = 4", "prompt_chunks = 4\nprompt_size = 3")
    assert_error(tmp_path, text, line_of(text, "prompt_size"),
                 "step 3 (add)", "unknown field 'prompt_size'",
                 "expected continues, fill_pool, kv_transfer_params, max_tokens")


def test_field_of_another_action(tmp_path: Path) -> None:
    text = replace(GOOD, "count = 2", "count = 2\nkind = \"store\"")
    assert_error(tmp_path, text, line_of(text, 'kind = "store"'),
                 "step 4 (schedule)", "unknown field 'kind'")


def test_unknown_subtable_of_a_step_points_at_its_header(tmp_path: Path) -> None:
    text = GOOD.replace("[[check]]", "[[step.extra]]\nx = 1\n\n[[check]]")
    assert_error(tmp_path, text, line_of(text, "[[step.extra]]"), "step 6 (abort)", "unknown field 'extra'")


def test_missing_required_field(tmp_path: Path) -> None:
    text = replace(GOOD, 'action = "abort"\nrequest = "B"', 'action = "abort"')
    assert_error(tmp_path, text, line_of(text, "[[step]]", 6), "step 6 (abort) needs 'request'")


@pytest.mark.parametrize("old,new,field,expected", [
    ("count = 2", "count = 0", "count", "must be a positive integer, got 0"),
    ("count = 2", "count = -3", "count", "must be a positive integer, got -3"),
    ("prompt_chunks = 4", "prompt_chunks = 0", "prompt_chunks", "must be a positive integer, got 0"),
    ("prompt_chunks = 4", "prompt_tokens = -16", "prompt_tokens", "must be a positive integer, got -16"),
    ("max_tokens = 8", "max_tokens = 0", "max_tokens", "must be a positive integer, got 0"),
    ("allocated_blocks = 0", "allocated_blocks = -1", "allocated_blocks", "must be >= 0, got -1"),
    ("store_jobs_built = 0", "store_jobs_built = -2", "store_jobs_built", "must be >= 0, got -2"),
])
def test_negative_or_zero_counts(tmp_path: Path, old: str, new: str, field: str, expected: str) -> None:
    text = replace(GOOD, old, new)
    assert_error(tmp_path, text, line_of(text, new), field, expected)


@pytest.mark.parametrize("sizes", [
    "max_tokens = 8",  # no size at all
    "prompt_chunks = 2\nprompt_tokens = 8",
    "fill_pool = false",
])
def test_add_needs_exactly_one_size(tmp_path: Path, sizes: str) -> None:
    text = replace(GOOD, "fill_pool = true\nmax_tokens = 8", sizes)
    assert_error(tmp_path, text, line_of(text, "[[step]]"),
                 "step 1 (add) needs exactly one of 'prompt_tokens', 'prompt_chunks', 'prompt', 'fill_pool = true', "
                 "'fill_pool = \"preempt_next\"' or 'prompt_rest_of_pool = true'")


def test_fill_pool_string_must_be_preempt_next(tmp_path: Path) -> None:
    text = replace(GOOD, "fill_pool = true", 'fill_pool = "yes"')
    assert_error(tmp_path, text, line_of(text, 'fill_pool = "yes"'), "step 1 (add) fill_pool",
                 "must be true (queue the next request) or \"preempt_next\"", "got 'yes'")


def test_preempt_fill_needs_a_rest_of_pool_add_after_it(tmp_path: Path) -> None:
    text = replace(GOOD, "fill_pool = true", 'fill_pool = "preempt_next"')
    assert_error(tmp_path, text, line_of(text, "[[step]]"), "step 1 (add) fill_pool = \"preempt_next\" needs a "
                 "later add with prompt_rest_of_pool = true")


def test_rest_of_pool_needs_a_preempt_fill_before_it(tmp_path: Path) -> None:
    text = replace(GOOD, "prompt_chunks = 4", "prompt_rest_of_pool = true")
    assert_error(tmp_path, text, line_of(text, "[[step]]", 3), "step 3 (add) prompt_rest_of_pool needs an earlier "
                 "add with fill_pool = \"preempt_next\"")


def test_preempt_fill_and_rest_of_pool_load(tmp_path: Path) -> None:
    text = replace(replace(GOOD, "fill_pool = true", 'fill_pool = "preempt_next"'), "prompt_chunks = 4",
                   "prompt_rest_of_pool = true")
    recipe = load_recipe_file(write(tmp_path, text))
    adds = [s.args for s in recipe.steps if s.action == "add"]
    assert adds[0]["fill_pool"] == "preempt_next" and adds[1]["prompt_rest_of_pool"] is True


@pytest.mark.parametrize("prompt", ["[]", "[1, 2, 5000]", "[1, -1]", '[1, "2"]', "[true]"])
def test_explicit_prompt_token_ids(tmp_path: Path, prompt: str) -> None:
    text = replace(GOOD, "prompt_chunks = 4", f"prompt = {prompt}")
    assert_error(tmp_path, text, line_of(text, "prompt = "), "step 3 (add) prompt",
                 "non-empty array of token ids in [0, 1024)")


def test_bad_transfer_kind(tmp_path: Path) -> None:
    text = replace(GOOD, 'action = "abort"\nrequest = "B"',
                   'action = "complete_transfers"\nrequest = "B"\nkind = "stores"')
    assert_error(tmp_path, text, line_of(text, "kind ="),
                 "step 6 (complete_transfers) kind must be one of store, load", "got 'stores'")


@pytest.mark.parametrize("action", ["hold_transfers", "complete_transfers", "fail_transfers"])
@pytest.mark.parametrize("kind", ["", 'kind = "store"\n', 'kind = "load"\n'])
def test_transfer_steps_accept_optional_request_and_kind(tmp_path: Path, action: str, kind: str) -> None:
    text = replace(GOOD, 'action = "abort"\nrequest = "B"\n', f'action = "{action}"\n{kind}')
    recipe = load_recipe_file(write(tmp_path, text))
    assert recipe.steps[-1].action == action


def test_bad_status_and_connector_state(tmp_path: Path) -> None:
    text = replace(GOOD, 'status = "WAITING"', 'status = "waiting"')
    assert_error(tmp_path, text, line_of(text, "waiting"), "step 5 (expect) status must be a RequestStatus name",
                 "got 'waiting'")
    text = replace(GOOD, 'status = "WAITING"', "status = []")
    assert_error(tmp_path, text, line_of(text, "status = []"), "status must name at least one RequestStatus")
    text = replace(GOOD, "store_jobs_built = 0", 'connector_state = "gone"')
    assert_error(tmp_path, text, line_of(text, "connector_state"),
                 "check 1 (expect) connector_state must be one of present, released", "got 'gone'")


def test_no_steps(tmp_path: Path) -> None:
    text = GOOD[: GOOD.index("[[step]]")]
    assert_error(tmp_path, text, 1, "a recipe needs at least one [[step]]")


def test_step_as_plain_table(tmp_path: Path) -> None:
    text = GOOD[: GOOD.index("[[step]]")] + '[step]\naction = "schedule"\n'
    assert_error(tmp_path, text, line_of(text, "[step]"), "[[step]] must be an array of tables")


# -- checks ------------------------------------------------------------------------


def test_check_with_unknown_request(tmp_path: Path) -> None:
    text = replace(GOOD, '[[check]]\nrequest = "B"', '[[check]]\nrequest = "X"')
    assert_error(tmp_path, text, line_of(text, 'request = "X"'), "check 1: unknown request 'X'", "added: A, B")


def test_check_takes_no_action(tmp_path: Path) -> None:
    text = replace(GOOD, '[[check]]\n', '[[check]]\naction = "expect"\n')
    assert_error(tmp_path, text, line_of(text, 'action = "expect"', 2), "check 1", "takes no 'action'")


def test_check_unknown_field(tmp_path: Path) -> None:
    text = replace(GOOD, "store_jobs_built = 0", "store_jobs = 0")
    assert_error(tmp_path, text, line_of(text, "store_jobs = 0"),
                 "check 1 (expect): unknown field 'store_jobs'", "store_jobs_built")


def test_check_needs_request(tmp_path: Path) -> None:
    text = replace(GOOD, '[[check]]\nrequest = "B"\n', "[[check]]\n")
    assert_error(tmp_path, text, line_of(text, "[[check]]"), "check 1 (expect) needs 'request'")


# -- [signature] ---------------------------------------------------------------------


def test_missing_signature(tmp_path: Path) -> None:
    text = replace(GOOD, '[signature]\nexception = "AssertionError"\nfunction = "_build_store_jobs"\n', "")
    assert_error(tmp_path, text, 1, "missing [signature] table", "exception + function, or invariant")


def test_signature_with_only_exception(tmp_path: Path) -> None:
    text = replace(GOOD, 'function = "_build_store_jobs"\n', "")
    assert_error(tmp_path, text, line_of(text, "[signature]"),
                 "[signature] needs 'exception' and 'function' (or 'invariant')", "missing 'function'")


def test_signature_with_only_function(tmp_path: Path) -> None:
    text = replace(GOOD, 'exception = "AssertionError"\n', "")
    assert_error(tmp_path, text, line_of(text, "[signature]"), "missing 'exception'")


def test_signature_invariant_and_exception(tmp_path: Path) -> None:
    text = replace(GOOD, 'function = "_build_store_jobs"', 'function = "f"\ninvariant = "no-leak"')
    assert_error(tmp_path, text, line_of(text, "[signature]"), "either 'invariant' or 'exception' + 'function'")


def test_signature_invariant_alone_loads(tmp_path: Path) -> None:
    text = replace(GOOD, 'exception = "AssertionError"\nfunction = "_build_store_jobs"',
                   'invariant = "no-orphan-transfer-jobs"')
    assert load_recipe_file(write(tmp_path, text)).signature.invariant == "no-orphan-transfer-jobs"


def test_signature_unknown_invariant(tmp_path: Path) -> None:
    text = replace(GOOD, 'exception = "AssertionError"\nfunction = "_build_store_jobs"', 'invariant = "no-leak"')
    assert_error(tmp_path, text, line_of(text, "invariant ="), "[signature] unknown invariant 'no-leak'",
                 "no-orphan-transfer-jobs")


def test_recipe_requires_and_invariants(tmp_path: Path) -> None:
    text = replace(GOOD, 'refs = ["vllm#1"]',
                   'refs = ["vllm#1"]\nrequires = ["spec:CPUOffloadingSpec"]\ninvariants = ["no-orphan-transfer-jobs"]')
    recipe = load_recipe_file(write(tmp_path, text))
    assert recipe.requires == ("spec:CPUOffloadingSpec",)
    assert recipe.invariants == ("no-orphan-transfer-jobs",)
    bad = replace(text, '"spec:CPUOffloadingSpec"', '"gpu:H100"')
    assert_error(tmp_path, bad, line_of(bad, "requires ="), "[recipe] requires: unknown requirement 'gpu:H100'",
                 "spec:<OffloadingSpec name>")
    bad = replace(text, '["no-orphan-transfer-jobs"]', '["no-leaks"]')
    assert_error(tmp_path, bad, line_of(bad, "invariants ="), "[recipe] invariants: unknown invariant 'no-leaks'")
    bad = replace(text, '["no-orphan-transfer-jobs"]', '"no-orphan-transfer-jobs"')
    assert_error(tmp_path, bad, line_of(bad, "invariants ="), "[recipe] invariants must be an array")


def test_signature_unknown_key_and_type(tmp_path: Path) -> None:
    text = replace(GOOD, 'function = "_build_store_jobs"', 'function = "_build_store_jobs"\nmessage = "x"')
    assert_error(tmp_path, text, line_of(text, "message ="), "[signature]: unknown key 'message'",
                 "contains, exception, function, function_aliases, invariant")
    text = replace(GOOD, 'exception = "AssertionError"', "exception = 1")
    assert_error(tmp_path, text, line_of(text, "exception = 1"), "[signature] exception must be a string, got 1")


def test_signature_not_a_table(tmp_path: Path) -> None:
    text = 'signature = "AssertionError"\n' + replace(
        GOOD, '[signature]\nexception = "AssertionError"\nfunction = "_build_store_jobs"\n', "")
    assert_error(tmp_path, text, 1, "[signature] must be a table")


# -- [setup] ---------------------------------------------------------------------------


def test_unknown_setup_key(tmp_path: Path) -> None:
    text = replace(GOOD, "gpu_blocks = 8", "gpu_blocks = 8\nnum_gpu_blocks = 8")
    assert_error(tmp_path, text, line_of(text, "num_gpu_blocks"),
                 "[setup]: unknown key 'num_gpu_blocks'", "block_size, blocks_per_chunk, cpu_bytes_to_use")


def test_setup_model_is_not_a_recipe_key(tmp_path: Path) -> None:
    text = replace(GOOD, "gpu_blocks = 8", 'gpu_blocks = 8\nmodel = "/models/x"')
    assert_error(tmp_path, text, line_of(text, "model ="), "[setup]: unknown key 'model'")


@pytest.mark.parametrize("new,expected", [
    ('gpu_blocks = "8"', "[setup] gpu_blocks must be an integer, got '8'"),
    ("gpu_blocks = 0", "[setup] gpu_blocks must be a positive integer, got 0"),
    ("gpu_blocks = -4", "[setup] gpu_blocks must be a positive integer, got -4"),
    ('gpu_blocks = 8\nasync_scheduling = "true"', "[setup] async_scheduling must be true or false, got 'true'"),
    ("gpu_blocks = 8\nspec_name = 3", "[setup] spec_name must be a string, got 3"),
    ("gpu_blocks = 8\nkv_connector_extra_config = 3", "[setup] kv_connector_extra_config must be a table, got 3"),
    ("gpu_blocks = 8\nworker = 1", "[setup] worker must be a string, got 1"),
    ('gpu_blocks = 8\nworker = "gpu"', '[setup] worker must be "simulated" or "vllm", got \'gpu\''),
])
def test_setup_value_types(tmp_path: Path, new: str, expected: str) -> None:
    text = replace(GOOD, "gpu_blocks = 8", new)
    assert_error(tmp_path, text, line_of(text, new.split("\n")[-1]), expected)


@pytest.mark.parametrize("worker", ["simulated", "vllm"])
def test_setup_names_its_worker(tmp_path: Path, worker: str) -> None:
    """A recipe may name the worker it runs with (explore's findings name the one they were found with);
    it was read as an integer, so no such recipe loaded."""
    text = replace(GOOD, "gpu_blocks = 8", f'gpu_blocks = 8\nworker = "{worker}"')
    assert load_recipe_file(write(tmp_path, text)).setup["worker"] == worker


def test_setup_extra_connector_config_table(tmp_path: Path) -> None:
    text = replace(GOOD, "[signature]", '[setup.kv_connector_extra_config]\nfoo = "bar"\n\n[signature]')
    recipe = load_recipe_file(write(tmp_path, text))
    assert recipe.setup["extra_connector_config"] == {"foo": "bar"}


# -- [recipe] and the top level -----------------------------------------------------------


def test_unknown_top_level_table(tmp_path: Path) -> None:
    text = GOOD + "\n[options]\nverbose = true\n"
    assert_error(tmp_path, text, line_of(text, "[options]"),
                 "unknown table [options]", "expected check, recipe, setup, signature, step")


def test_misspelt_array_table(tmp_path: Path) -> None:
    text = GOOD + '\n[[steps]]\naction = "schedule"\n'
    assert_error(tmp_path, text, line_of(text, "[[steps]]"), "unknown table [steps]")


def test_unknown_top_level_key(tmp_path: Path) -> None:
    text = 'version = 2\n' + GOOD
    assert_error(tmp_path, text, 1, "unknown top-level key 'version'")


def test_missing_recipe_table(tmp_path: Path) -> None:
    text = replace(GOOD, '[recipe]\nname = "mini"\n', "")
    text = text[text.index("[setup]"):]
    assert_error(tmp_path, text, 1, "missing [recipe] table")


def test_recipe_needs_name_and_summary(tmp_path: Path) -> None:
    text = replace(GOOD, 'name = "mini"\n', "")
    assert_error(tmp_path, text, line_of(text, "[recipe]"), "[recipe] needs 'name'")


def test_recipe_unknown_key_and_types(tmp_path: Path) -> None:
    text = replace(GOOD, 'name = "mini"', 'name = "mini"\nauthor = "me"')
    assert_error(tmp_path, text, line_of(text, "author"), "[recipe]: unknown key 'author'", "(expected one of bug, ",
                 "name", "refs", "summary", "title")
    text = replace(GOOD, 'refs = ["vllm#1"]', 'refs = "vllm#1"')
    assert_error(tmp_path, text, line_of(text, "refs ="), "[recipe] refs must be an array")
    text = replace(GOOD, 'refs = ["vllm#1"]', "refs = [1]")
    assert_error(tmp_path, text, line_of(text, "refs ="), "[recipe] refs entries must be a string, got 1")


def test_recipe_subtable_points_at_its_header(tmp_path: Path) -> None:
    text = replace(GOOD, "[setup]", "[recipe.meta]\nx = 1\n\n[setup]")
    assert_error(tmp_path, text, line_of(text, "[recipe.meta]"), "[recipe]: unknown key 'meta'")


# -- TOML syntax and bytes -------------------------------------------------------------------


def test_invalid_toml_syntax_line(tmp_path: Path) -> None:
    text = replace(GOOD, "count = 2", "count == 2")
    assert_error(tmp_path, text, line_of(text, "count == 2"), "invalid TOML", "column")


def test_invalid_toml_unclosed_string(tmp_path: Path) -> None:
    text = replace(GOOD, 'request = "B"\nprompt_chunks', 'request = "B\nprompt_chunks')
    assert_error(tmp_path, text, line_of(text, 'request = "B', 1), "invalid TOML")


def test_invalid_toml_at_end_of_file(tmp_path: Path) -> None:
    text = GOOD + "extra = [1,\n2,\n"
    assert_error(tmp_path, text, text.rstrip("\n").count("\n") + 1, "invalid TOML", "end of file")


def test_invalid_toml_duplicate_key(tmp_path: Path) -> None:
    text = replace(GOOD, "gpu_blocks = 8", "gpu_blocks = 8\ngpu_blocks = 9")
    assert_error(tmp_path, text, line_of(text, "gpu_blocks = 9"), "invalid TOML")


def test_non_utf8_bytes(tmp_path: Path) -> None:
    raw = replace(GOOD, "Two requests", "Two r\udcffequests").encode("utf-8", "surrogateescape")
    assert_error(tmp_path, raw, line_of(GOOD, "Two requests"), "not UTF-8", "0xff")


def test_latin1_file(tmp_path: Path) -> None:
    raw = replace(GOOD, "# a comment", "# caf\u00e9").encode("latin-1")
    assert_error(tmp_path, raw, 1, "not UTF-8", "0xe9")


def test_nul_byte(tmp_path: Path) -> None:
    raw = replace(GOOD, "count = 2", "count = 2\x00").encode()
    assert_error(tmp_path, raw, line_of(GOOD, "count = 2"), "NUL byte")


def test_binary_garbage(tmp_path: Path) -> None:
    path = write(tmp_path, bytes(range(256)) * 4)
    load_error(path)


def test_empty_file(tmp_path: Path) -> None:
    assert_error(tmp_path, "", 1, "missing [recipe] table")


def test_huge_integer_literal(tmp_path: Path) -> None:
    text = replace(GOOD, "gpu_blocks = 8", "gpu_blocks = " + "9" * 5000)
    assert_error(tmp_path, text, line_of(text, "gpu_blocks"), "invalid TOML", "number literal too long")


def test_deeply_nested_arrays(tmp_path: Path) -> None:
    text = GOOD.replace("refs = [\"vllm#1\"]", "refs = " + "[" * 5000 + "]" * 5000)
    assert_error(tmp_path, text, line_of(text, "refs ="), "invalid TOML", "nested too deeply")


def test_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    recipe = load_recipe_file(write(tmp_path, b"\xef\xbb\xbf" + GOOD.encode()))
    assert recipe.name == "mini"


def test_crlf_line_endings(tmp_path: Path) -> None:
    text = replace(GOOD, "count = 2", "count = 0")
    path = write(tmp_path, text.replace("\n", "\r\n").encode())
    message = load_error(path)
    assert message.startswith(f"{path}:{line_of(text, 'count = 0')}: "), message


# -- line numbers stay right -------------------------------------------------------------------


def test_table_lookalikes_inside_strings_do_not_shift_lines(tmp_path: Path) -> None:
    text = replace(GOOD, "Two requests; B is aborted while queued.",
                   "[[step]]\n[setup]\nrequest = \"fake\"\n  [[check]]")
    text = replace(text, "count = 2", "count = 0")
    assert_error(tmp_path, text, line_of(text, "count = 0"), "step 4 (schedule) count")
    recipe = load_recipe_text(GOOD.replace("Two requests", "[[step]]\nTwo requests"), "x.toml")
    assert recipe.steps[0].line == line_of(GOOD, "[[step]]") + 1


def test_multiline_arrays_and_comments(tmp_path: Path) -> None:
    text = replace(GOOD, 'refs = ["vllm#1"]', 'refs = [\n  "vllm#1", # a comment ]\n  "[[step]]",\n]')
    text = replace(text, 'action = "abort"', 'action = "abrot"')
    assert_error(tmp_path, text, line_of(text, "abrot"), "unknown action 'abrot'")


def test_unicode_line_separators_do_not_shift_lines(tmp_path: Path) -> None:
    # str.splitlines() would break at U+2028, U+2029 and U+0085; TOML (and the reported line) counts only \n.
    text = replace(GOOD, "# a comment", "# a \u2028 comment \u2029 \x85")
    text = replace(text, "count = 2", "count = -1")
    assert_error(tmp_path, text, line_of(text, "count = -1"), "count must be a positive integer")


def test_quoted_and_dotted_keys(tmp_path: Path) -> None:
    text = replace(GOOD, "count = 2", '"count" = 0')
    assert_error(tmp_path, text, line_of(text, '"count" = 0'), "count must be a positive integer")
    text = replace(GOOD, "gpu_blocks = 8", "gpu_blocks = 8\nextra.thing = 1")
    assert_error(tmp_path, text, line_of(text, "extra.thing"), "[setup]: unknown key 'extra'")


def test_messages_stay_one_line_with_odd_names(tmp_path: Path) -> None:
    text = replace(GOOD, "gpu_blocks = 8", '"gpu\\nblocks" = 8')
    message = assert_error(tmp_path, text, line_of(text, "gpu\\nblocks"), "[setup]: unknown key")
    assert "'gpu\\nblocks'" in message
    text = replace(GOOD, 'action = "abort"\nrequest = "B"', 'action = "abort"\nrequest = "B\\nC"')
    assert_error(tmp_path, text, line_of(text, 'request = "B\\nC"'), "unknown request 'B\\nC'")


def test_inline_step_array_reports_its_key_line(tmp_path: Path) -> None:
    head = GOOD[: GOOD.index("[[step]]")]
    text = 'step = [{action = "schedule"}, {action = "jump"}]\n' + head
    assert_error(tmp_path, text, 1, "step 2: unknown action 'jump'")


# -- files ---------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(RecipeError, match=r"nope\.toml: no such recipe file$"):
        load_recipe_file(path)


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="is a directory"):
        load_recipe_file(tmp_path)


def test_load_recipe_text_uses_source_name() -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe_text("[recipe\n", "<stdin>")
    assert str(info.value).startswith("<stdin>:1: invalid TOML")


# -- docs/recipes.md stays in step with the loader ------------------------------------------------

DOC = REPO / "docs" / "recipes.md"


def test_docs_worked_example_loads() -> None:
    import re

    blocks = re.findall(r"```toml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    complete = [b for b in blocks if "[recipe]" in b]
    assert complete, "docs/recipes.md lost its worked example"
    for block in complete:
        recipe = load_recipe_text(block, "docs/recipes.md example")
        assert recipe.steps


def test_docs_name_every_action_field_and_setup_key() -> None:
    import dataclasses

    from kvdoctor.engine.setup import RECIPE_KEY, Setup
    from kvdoctor.steps import REGISTRY

    # the step kinds and their fields: docs/recipes.md or the registry's own table, docs/steps.md (which
    # recipes.md links to for the whole vocabulary)
    doc = DOC.read_text(encoding="utf-8") + (REPO / "docs" / "steps.md").read_text(encoding="utf-8")
    assert "(steps.md)" in DOC.read_text(encoding="utf-8")
    names = set(REGISTRY) | {k for kind in REGISTRY.values() for k in kind.fields}
    names |= {f.name for f in dataclasses.fields(Setup) if f.metadata.get(RECIPE_KEY, True)}  # a recipe's keys
    names |= {"kv_connector_extra_config", "exception", "function", "contains", "invariant", "requires", "invariants",
              "reproduced", "not_reproduced", "other_failure", "not_applicable", "setup_error"}
    missing = sorted(name for name in names if f"`{name}`" not in doc)
    assert not missing, f"docs/recipes.md does not document: {missing}"
