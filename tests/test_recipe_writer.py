"""The recipe writer: whatever valid Recipe it is given, the loader reads back the same recipe.

Pure Python (no vLLM): built-in recipes, a finding-shaped recipe, and recipes
hypothesis builds from the recipe model's own vocabulary (arbitrary text in
every string, nested connector config, every action).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdoctor.engine.setup import MAX_GPU_BLOCKS
from kvdoctor.observe.invariants import INVARIANTS
from kvdoctor.recipes.builtins import all_builtins
from kvdoctor.recipes.loader import load_recipe_file, load_recipe_text
from kvdoctor.recipes.model import Recipe, Signature, Step
from kvdoctor.recipes.writer import recipe_to_toml, toml_string


def normalized(recipe: Recipe) -> Recipe:
    """What survives a write/load: no source, no builtin flag, no line numbers, stripped summary."""
    def plain(steps: tuple[Step, ...]) -> tuple[Step, ...]:
        return tuple(Step(s.action, dict(s.args), 0) for s in steps)
    return dataclasses.replace(recipe, source="", builtin=False, summary=recipe.summary.strip(),
                               steps=plain(recipe.steps), checks=plain(recipe.checks))


def round_trip(recipe: Recipe, **kwargs) -> Recipe:
    return load_recipe_text(recipe_to_toml(recipe, **kwargs), "written.toml")


@pytest.mark.parametrize("recipe", all_builtins(), ids=lambda r: r.name)
def test_builtin_recipes_round_trip(recipe):
    assert normalized(round_trip(recipe)) == normalized(recipe)


def test_header_comments_and_file(tmp_path: Path):
    recipe = Recipe(
        name="explore-x", summary="line one\nline \"two\" \\ with a backslash\n\ttabbed",
        signature=Signature(exception="AssertionError", function="build_connector_meta",
                            contains="assert self._jobs[any_jid].is_store"),
        steps=(Step("add", {"request": "A", "prompt_tokens": 4, "max_tokens": 2}, 0),
               Step("schedule", {"count": 2}, 0),
               Step("reset_prefix_cache", {"reset_running_requests": True}, 0)),
        setup={"block_size": 4, "gpu_blocks": 4, "async_scheduling": True},
        checks=(Step("expect", {"request": "A", "connector_state": "released", "description": "d"}, 0),),
        title="AssertionError in build_connector_meta")
    text = recipe_to_toml(recipe, header="found by explore\nseed 3", step_comments={1: "two steps"})
    assert text.startswith("# found by explore\n# seed 3\n[recipe]\n")
    assert "[[step]]  # two steps" in text
    path = tmp_path / "f.toml"
    path.write_text(text, encoding="utf-8")
    loaded = load_recipe_file(path)
    assert normalized(loaded) == normalized(recipe)
    assert loaded.steps[1].line == text.split("\n").index("[[step]]  # two steps") + 1


def test_strings_escape():
    for text in ['"', "\\", "a\nb", "\x00\x1f\x7f", "'''", '"""', "é✓"]:
        import tomllib

        assert tomllib.loads(f"k = {toml_string(text)}")["k"] == text


# -- generated recipes -----------------------------------------------------------------

texts = st.text(max_size=30)
names = st.text(max_size=30).filter(lambda name: "\n" not in name and "\r" not in name)  # a name is one line
ids = st.text(min_size=1, max_size=8)
scalars = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), texts,
                    st.floats(allow_nan=False))  # inf too: the writer spells it `inf`
config_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)), max_leaves=6)


@st.composite
def setups(draw):
    setup = {}
    for key in ("block_size", "blocks_per_chunk", "gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                "max_model_len", "cpu_bytes_to_use"):
        if draw(st.booleans()):  # the loader refuses a pool past what kvdoctor simulates (MAX_GPU_BLOCKS)
            setup[key] = draw(st.integers(1, MAX_GPU_BLOCKS if key == "gpu_blocks" else 1 << 40))
    for key in ("async_scheduling", "enable_chunked_prefill", "offload_prompt_only"):
        if draw(st.booleans()):
            setup[key] = draw(st.booleans())
    if draw(st.booleans()):
        setup["spec_name"] = draw(texts)
    if draw(st.booleans()):
        setup["extra_connector_config"] = draw(st.dictionaries(texts, config_values, min_size=1, max_size=4))
    return setup


@st.composite
def step_lists(draw):
    requests = draw(st.lists(ids, min_size=1, max_size=4, unique=True))
    steps, added = [], []
    for rid in requests:
        args = {"request": rid}
        size = draw(st.sampled_from(["prompt_tokens", "prompt_chunks", "prompt", "fill_pool"]))
        args[size] = {"prompt_tokens": draw(st.integers(1, 500)), "prompt_chunks": draw(st.integers(1, 9)),
                      "prompt": draw(st.lists(st.integers(0, 1023), min_size=1, max_size=5)),
                      "fill_pool": True}[size]
        if draw(st.booleans()):
            args["max_tokens"] = draw(st.integers(1, 64))
        if added and draw(st.booleans()):
            args["shared_prefix_with"] = draw(st.sampled_from(added))
            args["shared_prefix_tokens"] = draw(st.integers(1, 64))
        steps.append(Step("add", args, 0))
        added.append(rid)
        for _ in range(draw(st.integers(0, 3))):
            steps.append(draw(other_steps(added)))
    return tuple(steps), tuple(draw(st.lists(expectations(added), max_size=2)))


def expectations(added):
    return st.fixed_dictionaries({"request": st.sampled_from(added)}, optional={
        "status": st.one_of(st.sampled_from(["WAITING", "RUNNING"]),
                            st.lists(st.sampled_from(["PREEMPTED", "FINISHED_ABORTED"]), min_size=1)),
        "allocated_blocks": st.integers(0, 9), "min_in_flight_jobs": st.integers(0, 3),
        "connector_state": st.sampled_from(["present", "released"]), "description": texts,
    }).map(lambda args: Step("expect", args, 0))


def other_steps(added):
    request = st.sampled_from(added)
    kind = st.sampled_from(["store", "load"])
    transfer = st.fixed_dictionaries({}, optional={"request": request, "kind": kind})
    return st.one_of(
        st.fixed_dictionaries({}, optional={"count": st.integers(1, 9)}).map(lambda a: Step("schedule", a, 0)),
        request.map(lambda r: Step("abort", {"request": r}, 0)),
        request.map(lambda r: Step("finish", {"request": r}, 0)),
        transfer.map(lambda a: Step("hold_transfers", a, 0)),
        transfer.map(lambda a: Step("complete_transfers", a, 0)),
        transfer.map(lambda a: Step("fail_transfers", a, 0)),
        st.fixed_dictionaries({}, optional={"reset_running_requests": st.booleans(),
                                            "reset_connector": st.booleans()}).map(
            lambda a: Step("reset_prefix_cache", a, 0)),
        expectations(added),
    )


signatures = st.one_of(
    st.sampled_from(sorted(INVARIANTS)).map(lambda name: Signature(invariant=name)),
    st.builds(Signature, exception=texts, function=texts, contains=st.none() | texts),
)


@st.composite
def recipes(draw):
    steps, checks = draw(step_lists())
    return Recipe(
        name=draw(names), summary=draw(texts), signature=draw(signatures), steps=steps, checks=checks,
        setup=draw(setups()), bug=draw(st.none() | texts), title=draw(st.none() | texts),
        refs=tuple(draw(st.lists(texts, max_size=3))),
        requires=tuple(draw(st.lists(st.sampled_from(["spec:", "kv_cache_group_field:"]).flatmap(
            lambda kind: st.text(min_size=1, max_size=10).map(lambda v: kind + v)), max_size=2))),
        invariants=tuple(draw(st.lists(st.sampled_from(sorted(INVARIANTS)), max_size=2, unique=True))),
    )


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipes())
def test_generated_recipes_round_trip(recipe):
    assert normalized(round_trip(recipe)) == normalized(recipe)
