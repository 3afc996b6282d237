"""A recipe compiled once into concrete steps, and the scenario, the script exporter and explore's runner
all reading that one expansion. No vLLM: compiling is pure data."""

from __future__ import annotations

import dataclasses

import pytest

from kvdoctor.engine.overrides import Overrides
from kvdoctor.engine.setup import Setup
from kvdoctor.errors import InternalError, UsageError
from kvdoctor.explore.runner import expanded_actions
from kvdoctor.export.script import recipe_data
from kvdoctor.recipes.builtins import all_builtins, load_builtin
from kvdoctor.recipes.compile import compile_recipe, expand_counts
from kvdoctor.recipes.geometry import plan_fill
from kvdoctor.recipes.loader import load_recipe_text
from kvdoctor.recipes.model import Step
from kvdoctor.resolution import resolve_setup

FILL = """
[recipe]
name = "fill"
summary = "a fill, then the steps it needs"
[signature]
exception = "AssertionError"
function = "_build_store_jobs"
[[step]]
action = "add"
request = "A"
fill_pool = true
[[step]]
action = "schedule"
until = "filled"
[[step]]
action = "add"
request = "B"
prompt_chunks = 3
shared_prefix_with = "A"
shared_prefix_chunks = 1
[[step]]
action = "schedule"
until = "prefilled"
request = "B"
[[step]]
action = "schedule"
count = 2
[[step]]
action = "abort"
request = "B"
"""


def _at(**geometry) -> tuple:
    setup = Setup(**geometry)
    return compile_recipe(load_recipe_text(FILL, "fill.toml").steps, setup), setup


@pytest.mark.parametrize("geometry", [{}, {"gpu_blocks": 64, "block_size": 16, "max_num_batched_tokens": 32},
                                      {"gpu_blocks": 4000, "max_num_batched_tokens": 8, "max_model_len": 2048}])
def test_until_expands_at_the_geometry(geometry):
    compiled, setup = _at(**geometry)
    plan = plan_fill(setup, 8)
    fill, filled, add_b, prefilled, twice, abort = (
        [play for play in compiled.steps if play.index == i] for i in range(6))
    assert [r.request for r in fill[0].requests] == ["A"] + [f"A.{i}" for i in range(2, len(plan.prompts) + 1)]
    assert [len(r.prompt) for r in fill[0].requests] == list(plan.prompts)
    assert len(filled) == plan.steps
    b = add_b[0].requests[0]
    assert len(b.prompt) == 3 * setup.offloaded_block_size
    assert b.prompt[: setup.offloaded_block_size] == compiled.prompts["A"][: setup.offloaded_block_size]
    assert b.prompt[setup.offloaded_block_size:] != compiled.prompts["A"][setup.offloaded_block_size: len(b.prompt)]
    assert len(prefilled) == -(-len(b.prompt) // setup.max_num_batched_tokens)
    assert len(twice) == 2 and len(abort) == 1
    assert [play.counter for play in compiled.steps] == list(range(1, len(compiled.steps) + 1))
    assert all(play.repeats == len(filled) for play in filled)
    assert [play.repeat for play in twice] == [1, 2]


def test_the_geometry_changes_the_repeats():
    """The point of compiling at the run's geometry: the same recipe plays differently."""
    small, _ = _at()
    big, _ = _at(gpu_blocks=4000, max_num_batched_tokens=8, max_model_len=2048)
    assert len(small.steps) != len(big.steps)


def test_geometry_free_expansion_refuses_until():
    recipe = load_recipe_text(FILL, "fill.toml")
    with pytest.raises(InternalError, match=r"until = 'filled'.*needs a geometry"):
        expand_counts(recipe.steps)
    steps = (Step("add", {"request": "A", "prompt_tokens": 4}, 1), Step("schedule", {"count": 3}, 2),
             Step("abort", {"request": "A"}, 3))
    assert expand_counts(steps) == [(0, "add"), (1, "schedule"), (1, "schedule"), (1, "schedule"), (2, "abort")]
    compiled = compile_recipe(steps, Setup())
    assert expanded_actions(steps) == [(play.index, play.action) for play in compiled.steps]


def _replayed(exported: list[dict]) -> list[tuple]:
    """The exported script's steps as it plays them: adds by request and prompt, schedules by count."""
    out = []
    for step in exported:
        if step["action"] == "add":
            out.append(("add", step["args"]["request"], tuple(step["args"]["prompt"]), step["args"]["max_tokens"]))
        elif step["action"] == "schedule":
            out.extend([("schedule",)] * step["args"].get("count", 1))
        else:
            out.append((step["action"],))
    return out


@pytest.mark.parametrize("recipe", all_builtins(), ids=lambda r: r.name)
def test_the_exported_script_plays_the_compiled_steps(recipe):
    setup = resolve_setup(recipe)
    compiled = compile_recipe(recipe.steps, dataclasses.replace(setup, worker="simulated", device=None))
    expected = []
    for play in compiled.steps:
        if play.action == "add":
            expected += [("add", r.request, r.prompt, r.max_tokens) for r in play.requests]
        else:
            expected.append((play.action,))
    assert _replayed(recipe_data(recipe, setup)["steps"]) == expected


def test_an_impossible_fill_is_a_usage_error_on_export():
    recipe = load_builtin("queued-abort")
    setup = resolve_setup(recipe, Overrides(block_size=128, gpu_blocks=64, max_model_len=128))
    with pytest.raises(UsageError, match="cannot export queued-abort: a filler request needs"):
        recipe_data(recipe, setup)
