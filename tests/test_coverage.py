"""Crash-site coverage (kvdoctor/observe/coverage.py) on a stand-in engine class, without vLLM:
the site is found from the source, counted by the interpreter's tracing for that code object only,
and the tracing is removed on exit even when the run raises. The same counting on vLLM's real
scheduler is asserted by the recipe tests (tests/test_recipes_mamba.py, test_recipes_window.py)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest

from kvdoctor.errors import RecipeError
from kvdoctor.observe.coverage import SiteTracer, find_site, parse_when, site_tracer
from kvdoctor.observe.verdict import Outcome, apply_coverage
from kvdoctor.recipes.loader import load_recipe_text
from kvdoctor.recipes.model import Signature


class FakeScheduler:
    def update_state_after_alloc(self, computed: int, blocks: int, per_block: int = 16) -> int:
        total = 0
        for i in range(blocks):
            total += i
        assert (
            computed
            <= blocks * per_block
        )
        return total


FakeScheduler.__module__ = "vllm.fake_for_test"  # the site lookup only looks at vLLM's classes


class FakeMovedConnector:
    """A release where the prefix lookup's assert lives in `_lookup_complete_chunks` (0.28+'s spelling)."""

    def _lookup_complete_chunks(self, keys: int, needed: int) -> int:
        assert keys >= needed
        return keys


FakeMovedConnector.__module__ = "vllm.fake_for_test"


class FakeResettingScheduler:
    """A message written as adjacent literals, as 0.34.0's Scheduler.reset_prefix_cache writes its RuntimeError."""

    def reset_prefix_cache(self, ok: bool) -> bool:
        if not ok:
            raise RuntimeError("Failed to reset KV cache even when all the running requests are "
                               "preempted and moved to the waiting queue.")
        return True


FakeResettingScheduler.__module__ = "vllm.fake_for_test"
STATEMENT = "computed <= blocks * per_block"


def site(statement=STATEMENT, when=None, function="update_state_after_alloc"):
    engine = SimpleNamespace(scheduler=FakeScheduler(), connector_scheduler=None)
    return engine.scheduler, find_site(function, statement, (engine.scheduler, None), when)


def test_the_site_is_found_in_the_source_and_counted_with_its_closest_values():
    engine, found = site()
    assert found.gone is None and found.source == "assert (computed <= blocks * per_block)"
    with SiteTracer(found) as coverage:
        engine.update_state_after_alloc(16, 2)  # 16 <= 32
        engine.update_state_after_alloc(48, 3)  # 48 <= 48: on the edge
        engine.update_state_after_alloc(0, 1)
    assert coverage.hits == 3 and coverage.executed == 3
    assert (coverage.closest, coverage.margin) == ("48 <= 48", 0)
    assert coverage.line() == "reached 3x: held (closest: 48 <= 48)"


def test_a_site_when_counts_only_the_bugs_case():
    engine, found = site(when="computed % per_block != 0")
    with SiteTracer(found) as coverage:
        engine.update_state_after_alloc(16, 2)
        engine.update_state_after_alloc(32, 2)
    assert (coverage.executed, coverage.hits) == (2, 0) and not coverage.reached
    assert coverage.line().startswith("not reached: the run executed update_state_after_alloc's")
    assert "never with `computed % per_block != 0`" in coverage.line()
    with SiteTracer(found) as coverage:
        engine.update_state_after_alloc(20, 2)
    assert coverage.hits == 1


def test_a_site_never_executed_is_not_reached_and_the_verdict_says_so():
    _, found = site()
    with SiteTracer(found) as coverage:
        pass
    result = SimpleNamespace(outcome=Outcome.NOT_REPRODUCED, detail="", coverage=coverage)
    apply_coverage(result, Signature(exception="AssertionError", function="update_state_after_alloc"))
    assert result.outcome is Outcome.NOT_REACHED
    assert result.detail.startswith("not reached: the recipe's path does not reach update_state_after_alloc's")


@pytest.mark.parametrize("function, statement, gone", [
    ("no_such_function", STATEMENT, "no function no_such_function"),
    ("update_state_after_alloc", "computed < blocks", "FakeScheduler.update_state_after_alloc has no statement"),
])
def test_a_site_gone_from_the_source_is_said_and_keeps_not_reproduced(function, statement, gone):
    _, found = site(statement, function=function)
    assert found.gone and gone in found.gone
    with SiteTracer(found) as coverage:
        pass
    result = SimpleNamespace(outcome=Outcome.NOT_REPRODUCED, detail="", coverage=coverage)
    apply_coverage(result, Signature(exception="AssertionError", function=function))
    assert result.outcome is Outcome.NOT_REPRODUCED and result.detail.startswith("site gone: ")


@pytest.mark.parametrize("site_function, gone", [("_lookup", False), ("_lookup_complete_chunks", False),
                                                  ("_lookup_keys", True)])
def test_a_site_function_is_found_under_every_spelling_of_the_adapters_names_table(site_function, gone):
    """`site_function` (not only `function`) takes the adapter's spellings: a recipe naming `_lookup`, with no
    `function_aliases` of its own, finds the statement where a release moved it (`_lookup_complete_chunks`);
    a name the table does not know stays gone."""
    harness = SimpleNamespace(scheduler=FakeScheduler(), connector_scheduler=FakeMovedConnector())
    signature = Signature(invariant="kv-content", site_function=site_function, site="keys >= needed")
    tracer = site_tracer(signature, harness)
    assert bool(tracer.site.gone) is gone, tracer.site.gone
    if not gone:
        assert tracer.site.where.startswith("FakeMovedConnector._lookup_complete_chunks"), tracer.site.where
        with tracer as coverage:
            harness.connector_scheduler._lookup_complete_chunks(3, 2)
        assert coverage.hits == 1


def test_the_assertion_firing_counts_and_the_trace_is_removed_when_the_run_raises():
    engine, found = site()
    before = sys.gettrace()
    with pytest.raises(AssertionError), SiteTracer(found) as coverage:
        engine.update_state_after_alloc(64, 1)
    assert sys.gettrace() is before
    assert coverage.hits == 1 and coverage.closest == "64 <= 16"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12+ counts with sys.monitoring, not settrace")
def test_a_trace_function_already_installed_keeps_seeing_other_frames():
    engine, found = site()
    seen = []

    def outer(frame, event, arg):
        seen.append(frame.f_code.co_name)
        return None

    previous = sys.gettrace()
    sys.settrace(outer)
    try:
        with SiteTracer(found) as coverage:
            (lambda: engine.update_state_after_alloc(16, 2))()
        assert sys.gettrace() is outer
    finally:
        sys.settrace(previous)
    assert coverage.hits == 1 and "<lambda>" in seen


class FakeOffloadManager:
    """A vLLM-side class `observe.function_lines` finds among the loaded connector modules (no vLLM needed)."""

    def prepare_store(self, keys: list[int]) -> int:
        total = 0
        for key in keys:
            total += key
        return total


FakeOffloadManager.__module__ = "vllm.fake_offload_for_test"


def _lines_seen_by_a_tracer_installed_before(code, scope, call):
    """The line events of `code` that a trace function installed before `scope` sees while `call` runs in it
    (and once with no scope, for comparison); the trace function must be back in place after the scope."""
    def record(into):
        def outer(frame, event, arg):
            if frame.f_code is code and event == "line":
                into.append(frame.f_lineno - code.co_firstlineno)
            return outer
        return outer

    alone, beside = [], []
    previous = sys.gettrace()
    try:
        sys.settrace(record(alone))
        call()
        outer = record(beside)
        sys.settrace(outer)
        with scope() as counted:
            call()
        assert sys.gettrace() is outer
    finally:
        sys.settrace(previous)
    assert alone, "the trace function saw nothing at all: the comparison would be vacuous"
    return alone, beside, counted


def test_a_trace_function_already_installed_sees_the_lines_the_function_counter_traces(monkeypatch):
    """Review D5: the hunt's per-call line counter chains a trace function installed before it (a debugger,
    coverage.py): that tracer sees every line of the traced function as it would alone, and both count."""
    from kvdoctor.observe.function_lines import FunctionLines

    module = ModuleType("vllm.fake_offload_for_test")
    module.FakeOffloadManager = FakeOffloadManager
    monkeypatch.setitem(sys.modules, module.__name__, module)
    manager = FakeOffloadManager()
    alone, beside, reach = _lines_seen_by_a_tracer_installed_before(
        FakeOffloadManager.prepare_store.__code__,
        lambda: FunctionLines("prepare_store", lambda: 7, file=__file__),  # vLLM's own managers may be loaded
        lambda: manager.prepare_store([1, 2]))
    assert beside == alone == [1, 2, 3, 2, 3, 2, 4]
    assert reach.measured and (reach.calls, reach.examples) == (1, 1)
    assert reach.reached == reach.statements and len(reach.statements) == 4, reach


def test_a_trace_function_already_installed_sees_the_lines_the_site_tracer_traces():
    engine, found = site()
    alone, beside, coverage = _lines_seen_by_a_tracer_installed_before(
        FakeScheduler.update_state_after_alloc.__code__, lambda: SiteTracer(found),
        lambda: engine.update_state_after_alloc(16, 2))
    assert beside == alone and coverage.hits == 1


@pytest.mark.parametrize("text, message", [
    ("__import__('os')", "only len, min, max and abs may be called"),
    ("[x for x in y]", "ListComp is not allowed"),
    ("a <=", "not an expression"),
])
def test_site_when_is_data_not_code(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_when(text)


_RECIPE = """[recipe]
name = "x"
summary = "x"
[signature]
{signature}
[[step]]
action = "schedule"
"""


def test_the_signature_names_its_site_and_defaults_to_function_and_contains():
    recipe = load_recipe_text(_RECIPE.format(signature='exception = "AssertionError"\nfunction = "f"\n'
                                                       'contains = "a <= b"'), "x.toml")
    assert recipe.signature.crash_site() == ("f", "a <= b")
    recipe = load_recipe_text(_RECIPE.format(signature='invariant = "store-covers-computed-slots"\n'
                                                       'site_function = "g"\nsite = "x = 1"\n'
                                                       'site_when = "x > 0"'), "x.toml")
    assert recipe.signature.crash_site() == ("g", "x = 1") and recipe.signature.site_when == "x > 0"


@pytest.mark.parametrize("signature, message", [
    ('invariant = "store-covers-computed-slots"\nsite = "x = 1"', "site needs 'site_function'"),
    ('exception = "E"\nfunction = "f"\nsite_when = "f()"', "site_when 'f()': only len"),
    ('exception = "E"\nfunction = "f"\nsite_function = "a.b"\nsite = "x"', "site_function must be a function"),
])
def test_a_bad_site_is_refused_with_its_line(signature, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_recipe_text(_RECIPE.format(signature=signature), "x.toml")


def test_every_builtin_recipe_names_a_crash_site():
    from kvdoctor.recipes.builtins import builtin_names, load_builtin

    assert all(load_builtin(name).signature.crash_site() for name in builtin_names())


# -- the measured release table (kvdoctor/data/release_outcomes.toml): pure data, no vLLM -----------

def _rows():
    from kvdoctor.matrix import data

    return data.load()


def test_every_measured_row_records_coverage_that_agrees_with_its_outcome():
    """Each row carries its run's coverage line, and the line agrees with the outcome: reproduced where
    the site fired, not_reached where the run never reached it (and only there)."""
    agree = {"reproduced": {"fired"}, "not_reproduced": {"held", "gone"}, "not_reached": {"not_reached"},
             "other_failure": {"fired", "held", "not_reached", "gone"},
             "setup_error": {"held", "not_reached", "gone"}, "not_applicable": {None, "not_reached", "gone"}}
    wrong = [f"{r.release} {r.recipe}: {r.outcome} with '{r.coverage}'" for r in _rows()
             if r.coverage_class not in agree.get(r.outcome, set())]
    assert not wrong, wrong


def test_a_release_counts_as_fixed_only_where_a_run_earned_it():
    """The upgrade hint counts a bug fixed at a release only where every one of its recipes reached its
    site and held there, or the site is gone (`earns_fixed`); a not_reached row never earns it."""
    from kvdoctor.matrix.data import OutcomeRow

    base = dict(release="0.27.0", recipe="r", bug="K7", failure_site=None, measured_on="2026-12-04",
                kvdoctor_version="0")
    assert OutcomeRow(outcome="not_reproduced", coverage="reached 2x: held (closest: 64 <= 64)", **base).earns_fixed
    assert OutcomeRow(outcome="not_reproduced", coverage="site gone: no statement", **base).earns_fixed
    assert not OutcomeRow(outcome="not_reached", coverage="not reached: the run executed x 2x", **base).earns_fixed
    assert not OutcomeRow(outcome="not_reproduced", coverage=None, **base).earns_fixed
    for row in _rows():
        if row.coverage_class == "not_reached":
            assert not row.earns_fixed, row


def test_audit_summary_gives_no_verdict_only_to_a_bug_no_recipe_decided():
    """K7 on 0.27.0: one recipe not_reached, the other reproduced. The bug has its verdict (it reproduces);
    the summary's "no verdict" is for a bug none of whose recipes reached its site."""
    from kvdoctor.report.tables import audit_summary

    def row(bug, outcome):
        return SimpleNamespace(bug=bug, installed=SimpleNamespace(outcome=Outcome(outcome)))

    report = SimpleNamespace(rows=[row("K7", "not_reached"), row("K7", "reproduced"), row("K12", "not_reached"),
                                   row("K12", "not_reached")],
                             reproducing={"K7": ["mamba-swa-diverged-hit-load"]}, vllm_version="0.27.0",
                             upgrade_hint=None)
    text = audit_summary(report)
    assert text.startswith("1 of 2 known bugs reproduce on vLLM 0.27.0")
    assert text.endswith("; no verdict: K12 not_reached") and "K7 not_reached" not in text  # once a bug


def test_a_message_split_over_adjacent_literals_is_found_by_its_value():
    """The exception prints one message; the source spells it as two literals: the site is that raise and its
    `if`, not "gone" (`kvdoctor repro` with offloading off said the code changed on 0.34.0); a run through the
    `if` that does not raise reached the site and it held."""
    engine = FakeResettingScheduler()
    found = find_site("reset_prefix_cache", "running requests are preempted and moved to the waiting queue",
                      (engine, None))
    assert found.gone is None and found.source == "if not ok:", (found.gone, found.source)  # the raise's guard
    with SiteTracer(found) as coverage:
        engine.reset_prefix_cache(True)
    assert coverage.line().startswith("reached 1x: held"), coverage.line()
