"""Silent bugs as a client sees them (issue 38): the stand-in model answers from the KV it reads, and
`--engine core` compares every request's completion with offloading on against the same steps with
offloading off.

The recipes run in this process (tests/cli_runner.invoke, one vLLM import). Expectations come from
kvdoctor's own measurements: a silent bug that stores wrong KV (K4, whose scheduler-level outcome on
this release is in kvdoctor/data/release_outcomes.toml) changes a client's completion exactly where
the release has the bug (K4; K9 under vLLM's MultiConnector, whose reader D loads A's chunk from the watched
tier); one that only loses prefix hits (K11: `explore.impact` says lost hits) leaves every completion equal.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from kvdoctor.engine.answer_key import FIRST_ANSWER_TOKEN, answer_of, next_key, words_bytes
from kvdoctor.engine.tiny_model import ContextKeys
from kvdoctor.explore.impact import LOST_HITS, WRONG_KV, impact_of
from kvdoctor.matrix import data
from kvdoctor.observe.verdict import compare_completions
from tests.cli_runner import invoke

# -- the stand-in's answer (no vLLM) -------------------------------------------------------------------

def test_the_answer_is_a_function_of_the_kv_read() -> None:
    tokens = [10, 141, 272, 403]
    keys: list[int] = []
    for token in tokens:
        keys.append(next_key(keys[-1] if keys else 0, token))
    right = answer_of(words_bytes(keys))
    assert right == ContextKeys().answer("A", tokens, len(tokens))  # right KV: the tokens decide
    assert FIRST_ANSWER_TOKEN <= right[0] < 1024 and right[1] <= 0
    stale = answer_of(words_bytes([*keys[:-1], next_key(keys[-2], 999)]))  # one slot of other tokens
    never_written = answer_of(words_bytes([*keys[:-1], int.from_bytes(b"\x5a" * 8, "little", signed=True)]))
    assert right[0] != stale[0] and right[0] != never_written[0]


def test_context_keys_start_over_when_a_request_changed_below_them() -> None:
    keys = ContextKeys()
    first = keys.answer("A", [10, 20, 30], 3)
    assert keys.answer("A", [10, 21, 30], 3) != first
    assert keys.answer("A", [10, 20, 30], 3) == first


def test_completions_compare_token_by_token_over_what_both_have() -> None:
    answers = compare_completions({"A": [5, 6, 7], "B": [9, 9], "C": [1, 2, 3, 4]},
                                  {"A": [5, 6, 7], "B": [9, 9, 9], "C": [1, 2, 8, 4], "D": [3]}, "offloading off")
    assert [d.request for d in answers.differing] == ["C"]
    assert answers.reproduced and answers.missing == ["D"]
    assert answers.differing[0].got_logprob is None  # no logprobs given
    assert answers.line == ("request C's completion differs from the reference (offloading off) at token 2: 3 where "
                            "the reference has 8")
    same = compare_completions({"A": [5]}, {"A": [5]}, "offloading off")
    assert not same.reproduced and same.line == "every completion equals the reference (offloading off): requests A"


# -- through vLLM's EngineCore -------------------------------------------------------------------------

def _core(recipe: str) -> dict:
    proc = invoke("repro", recipe, "--engine", "core", "--logic", "installed", "--json")
    if proc.returncode == 3:
        pytest.skip(f"no usable vLLM here: {proc.stderr.strip()}")
    assert proc.returncode in (0, 1, 6), proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _measured(release: str, recipe: str) -> str:
    rows = [r for r in data.load() if r.release == release and r.recipe == recipe]
    if not rows:
        pytest.skip(f"kvdoctor/data/release_outcomes.toml has no {recipe} row for vLLM {release}")
    return rows[0].outcome


@pytest.mark.vllm
def test_k4_a_clients_next_turn_gets_another_answer_where_the_release_has_the_bug(api) -> None:
    doc = _core("final-token-slot-stored")
    result = doc["results"][0]
    measured = _measured(doc["vllm_version"], "final-token-slot-stored")
    assert result["outcome"] == measured
    answers = result["answers"]
    assert answers is not None and answers["not_compared"] is None, answers
    assert impact_of("invariant", "store-covers-computed-slots", "").kind == WRONG_KV
    by_request = {r["request"]: r for r in answers["requests"]}
    assert set(by_request) == {"A", "C"}  # A ends at max_tokens = 1: its one token is computed from right KV
    assert by_request["A"]["position"] is None and by_request["A"]["got_tokens"] == 1, by_request["A"]
    if measured == "reproduced":  # C's prefix hit A's stored chunk and read its never-written slot
        assert answers["reproduced"] and by_request["C"]["position"] == 0, answers
        assert by_request["C"]["got_logprob"] <= 0 and by_request["C"]["expected_logprob"] <= 0, answers
        assert answers["line"].startswith("request C's completion differs from the reference (offloading off) "
                                          "at token 0: ")
    else:  # nothing wrong stored: C's answer is the one the engine computes itself
        assert not answers["reproduced"] and by_request["C"]["expected_tokens"] == 3, answers


@pytest.mark.vllm
def test_k11_loses_prefix_hits_and_no_client_answer(api) -> None:
    doc = _core("readmitted-stale-store-cursor")
    result = doc["results"][0]
    assert result["outcome"] == _measured(doc["vllm_version"], "readmitted-stale-store-cursor")
    assert impact_of("invariant", "readmitted-chunks-offered-again", "").kind == LOST_HITS
    answers = result["answers"]
    assert answers is not None and not answers["reproduced"] and answers["not_compared"] is None, answers
    assert {r["request"] for r in answers["requests"]} == {"A", "B"}
    assert all(r["got_tokens"] == r["expected_tokens"] > 0 for r in answers["requests"]), answers


def _step(new: list[Any] = (), cached: tuple[list[str], set[str], list[Any]] = ([], set(), []),
          scheduled: dict[str, int] | None = None, preempted: tuple[str, ...] = ()) -> Any:
    """A scheduler output as the toy model reads it (the fields of vLLM's SchedulerOutput it uses)."""
    ids, resumed, blocks = cached
    return SimpleNamespace(finished_req_ids=set(), preempted_req_ids=set(preempted), scheduled_new_reqs=list(new),
                           num_scheduled_tokens=scheduled or {},
                           scheduled_cached_reqs=SimpleNamespace(req_ids=ids, resumed_req_ids=resumed,
                                                                 all_token_ids={}, new_block_ids=blocks,
                                                                 num_computed_tokens=[0] * len(ids)))


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_the_toy_model_answers_a_request_resumed_after_its_preemption(runner: str) -> None:
    """V1 sends a resumed request among the cached ones and ignores `preempted_req_ids` (only V2 reads it):
    the toy model keeps the request's state there, so its tokens after the re-admission are answered
    (K11 at serve on 0.26.0 / 0.30.0, V1 runner: B's tokens went unanswered from engine step 150)."""
    pytest.importorskip("torch")
    from kvdoctor.engine.workers.toy_model import ToyModel

    api = SimpleNamespace(preempted_req_ids=lambda o: o.preempted_req_ids, resumed_req_ids=lambda c: c.resumed_req_ids,
                          all_token_ids=lambda c: c.all_token_ids, scheduled_new_tokens=lambda n: n.prompt_token_ids,
                          block_ids_to_zero=lambda o: (), block_copies=lambda o: ())
    model = ToyModel(api, [], runner)
    new_b = SimpleNamespace(req_id="B", prompt_token_ids=[5, 6, 7], block_ids=[[1]], num_computed_tokens=0)
    for output in (_step(new=[new_b], scheduled={"B": 3}), _step(preempted=("B",))):
        model.update_states(output)
        model.forward(output, {"B": [0]} if output.num_scheduled_tokens else {})
    model.logprobs.clear()
    resumed = (_step(cached=(["B"], {"B"}, [([2],)]), scheduled={"B": 4}) if runner == "v1" else
               _step(new=[SimpleNamespace(req_id="B", prompt_token_ids=[5, 6, 7, 9], block_ids=[[2]],
                                          num_computed_tokens=0)], scheduled={"B": 4}))
    model.update_states(resumed)
    sampled = {"B": [0]}
    model.forward(resumed, sampled)
    assert "B" in model.logprobs and sampled["B"][0] >= FIRST_ANSWER_TOKEN


@pytest.mark.vllm
def test_k9_a_reader_of_as_chunk_gets_another_answer_where_the_release_has_the_bug(api) -> None:
    """vLLM's worker drives the MultiConnector: the second connector's load writes P's bytes into A's reused
    block, A's unflushed store copies them (late, as kvdoctor's copy engine does) into the watched tier as A's
    chunk, and D, whose prompt starts with A's chunk, loads them from there (measured: 0.26.0 D differs at token
    0, 599 where the reference has 332; 0.34.0, which flushes A's store in C's step, every completion equal)."""
    doc = _core("reused-block-unfenced-multiconnector")
    result = doc["results"][0]
    measured = _measured(doc["vllm_version"], "reused-block-unfenced-multiconnector")
    assert result["outcome"] == measured
    assert result["worker"].startswith("vLLM worker-role MultiConnector"), result["worker"]
    answers = result["answers"]
    assert answers is not None and answers["not_compared"] is None, answers
    by_request = {r["request"]: r for r in answers["requests"]}
    assert set(by_request) == {"A", "P", "C", "D"}, answers
    for name in ("A", "P", "C"):  # their KV is their own (C's loaded by the second connector, right bytes)
        assert by_request[name]["position"] is None, answers
    if measured == "reproduced":
        assert answers["reproduced"] and by_request["D"]["position"] == 0, answers
        assert answers["line"].startswith("request D's completion differs from the reference (offloading off) "
                                          "at token 0: ")
    else:
        assert not answers["reproduced"] and by_request["D"]["got_tokens"] == by_request["D"]["expected_tokens"] == 2


# -- at --engine serve (no vLLM: the traffic and the client's reading of an answer) ------------------------

def test_k9s_server_runs_the_multiconnector_with_the_recipes_chunk_counts() -> None:
    """The served tiny Llama keeps 256 bytes of KV a token (2 layers x K, V x 2 heads x 16 x fp16) where the
    in-process levels keep 64: the recipe's 4 KiB watched tier is one chunk there and must be one here (measured
    on 0.26.0: at 4 KiB the served watched connector stored nothing and no client's answer could differ)."""
    from kvdoctor import app
    from kvdoctor.engine.tiny_model import tiny_model_dir
    from kvdoctor.levels import serve
    from kvdoctor.recipes.builtins import resolve

    recipe = resolve("reused-block-unfenced-multiconnector")
    setup = serve.serve_setup(app.resolve_setup(recipe, worker_fallback=True), recipe)
    assert setup.worker == "vllm" and serve.answers_unexpressible(recipe, setup) == []
    model = tiny_model_dir()
    command = serve.serve_command(setup, model, 0)  # its tiers in the served model's bytes (served_tiers)
    ktc = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector"] == "MultiConnector"
    watched, second = (c["kv_connector_extra_config"] for c in ktc["kv_connector_extra_config"]["connectors"])
    served_chunk = 64 * 256
    assert watched["cpu_bytes_to_use"] // served_chunk == setup.cpu_bytes_to_use // (64 * 64) == 1
    assert second["cpu_bytes_to_use"] // served_chunk == setup.second_cpu_bytes_to_use // (64 * 64)


def test_k4s_traffic_caps_a_at_one_token_and_c_continues_as_as_client_has_it() -> None:
    from kvdoctor import app
    from kvdoctor.levels import serve
    from kvdoctor.recipes.builtins import resolve

    recipe = resolve("final-token-slot-stored")
    setup = serve.serve_setup(app.resolve_setup(recipe, worker_fallback=True))
    assert serve.unplayable(recipe, setup, "the client") == []
    events = serve.plan_traffic(recipe, setup)
    adds = {e.request: e for e in events if e.kind == "add"}
    assert adds["A"].max_tokens == 1 and adds["C"].continues == "A"  # A ends at max_tokens, as the recipe says
    assert not any("vllm_xargs" in e.extra for e in adds.values()) and not serve.executor_plan(recipe, setup)


def test_a_late_finish_is_the_executors_plan_for_a_silent_recipe_and_not_applicable_for_a_crash() -> None:
    from kvdoctor.engine.setup import Setup
    from kvdoctor.levels import serve
    from kvdoctor.recipes.model import Recipe, Signature, Step

    steps = (Step("add", {"request": "A", "prompt_tokens": 4}, 1), Step("schedule", {}, 2),
             Step("finish", {"request": "A"}, 3), Step("schedule", {}, 4))
    silent = Recipe("late-finish", "a finish after A ran", Signature(invariant="store-covers-computed-slots"), steps)
    assert serve.unplayable(silent, Setup(worker="simulated"), "the client") == []
    assert serve.executor_plan(silent, Setup(worker="simulated")) == [
        {"step": 2, "action": "eos", "request": "A", "tag": "kvdoctor-A-r", "kind": None}]  # A's 2nd engine step
    crash = Recipe("late-finish", "a finish after A ran", Signature(exception="AssertionError", function="f"), steps)
    reasons = serve.unplayable(crash, Setup(worker="simulated"), "the client")
    assert len(reasons) == 1 and "(line 3) `finish` cannot be played through vllm serve" in reasons[0], reasons


def test_k11s_transfer_hold_and_late_finish_are_the_served_executors_plan_by_engine_step() -> None:
    """K11 at serve: B's stores held from its arrival (engine step 4, after three), A's EOS at engine step 148
    (3 + 3 + 1 + 140 steps before it); the exported script carries that plan (its stand-in executor plays it)."""
    from kvdoctor import app
    from kvdoctor.export.script import serve_recipe_data
    from kvdoctor.levels import serve
    from kvdoctor.recipes.builtins import resolve

    recipe = resolve("readmitted-stale-store-cursor")
    setup = serve.serve_setup(app.resolve_setup(recipe, worker_fallback=True), recipe)
    assert serve.unplayable(recipe, setup, "the client") == []
    plan = [{"step": 4, "action": "hold", "request": "B", "tag": "kvdoctor-B-r", "kind": "store"},
            {"step": 148, "action": "eos", "request": "A", "tag": "kvdoctor-A-r", "kind": None}]
    assert serve.executor_plan(recipe, setup) == plan
    assert serve_recipe_data(recipe, app.resolve_setup(recipe, worker_fallback=True))["plan"] == plan


def test_the_client_reads_its_prefix_hits_from_the_usage() -> None:
    from kvdoctor.levels.serve_client import cached_tokens

    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 16}}})
    assert cached_tokens(body) == 16
    assert cached_tokens(json.dumps({"usage": {"prompt_tokens_details": None}})) is None


def test_the_client_reads_token_ids_and_the_stop_token_it_was_told_of() -> None:
    from kvdoctor.levels.serve_client import completion_tokens

    body = json.dumps({"choices": [{"token_ids": [], "finish_reason": "stop", "stop_reason": 2}]})
    assert completion_tokens(body) == [2]  # the EOS the server names as the stop reason, as the client has it
    body = json.dumps({"choices": [{"token_ids": [172, 5, 9], "finish_reason": "length", "stop_reason": None}]})
    assert completion_tokens(body) == [172, 5, 9]
    assert completion_tokens("not json") is None and completion_tokens('{"choices": [{}]}') is None


def test_the_served_executor_reads_the_eos_schedule_the_client_sends() -> None:
    """The stand-in executor (vLLM-only: exported scripts embed it) spells the EOS schedule's key and the stop
    token itself; they must be the ones the serve level sends (names.py, step_loop.py)."""
    import re
    from pathlib import Path

    from kvdoctor.engine.core.names import EOS_AFTER_ARG
    from kvdoctor.engine.step_loop import EOS_TOKEN

    source = (Path(__file__).parents[1] / "kvdoctor" / "engine" / "core" / "standin_executor.py").read_text()
    assert re.search(rf'^EOS_AFTER_ARG = "{EOS_AFTER_ARG}"', source, re.M)
    assert re.search(rf"^EOS_TOKEN = {EOS_TOKEN}\b", source, re.M)
