"""`kvdoctor audit`, Markdown/SVG attachments, and exported standalone scripts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from kvdoctor import SCHEMA_VERSION

from .cli_runner import invoke
from .conftest import ROOT
from .recipe_runs import SECRET

K1_RECIPES = ("queued-abort", "preemption", "prefetch")


@pytest.fixture(scope="module")
def k1_outcome(api):
    """The installed logic's outcome on the K1 recipes, as kvdoctor measured it on this release
    (kvdoctor/data/release_outcomes.toml: `kvdoctor matrix --audit`, the same audit at its defaults).
    The three recipes share one fix (PR #49118), so their rows must agree; a data file where they
    disagree fails here rather than picking one."""
    from .recipe_runs import measured

    outcomes = {name: measured(api, name).value for name in K1_RECIPES}
    assert len(set(outcomes.values())) == 1, f"the K1 recipes' measured outcomes disagree: {outcomes}"
    return next(iter(outcomes.values()))


@pytest.fixture(scope="module")
def shared_audit(api):
    """`kvdoctor audit --json --report ~/audit.md` with $HOME an empty folder and a secret in the environment:
    the session's one audit (tests/recipe_runs.cli_audit_run), which the README's examples and the
    release-outcomes check read too."""
    from .recipe_runs import cli_audit_run

    return cli_audit_run()


@pytest.fixture(scope="module")
def home(shared_audit):
    """The audit's home directory, whose path must never show up in a report."""
    return shared_audit.home


@pytest.fixture(scope="module")
def audit_run(shared_audit):
    return shared_audit.proc, shared_audit.doc, shared_audit.markdown


def test_audit_rows_and_exit_code(audit_run, release, k1_outcome):
    proc, doc, _ = audit_run
    assert doc["schema_version"] == SCHEMA_VERSION and doc["vllm_version"].startswith(f"{release[0]}.{release[1]}.")
    rows = {row["recipe"]: row for row in doc["rows"]}
    assert set(K1_RECIPES) <= set(rows)
    for name in K1_RECIPES:
        assert rows[name]["bug"] == "K1" and any("49118" in ref for ref in rows[name]["refs"])
        assert rows[name]["outcome"] == k1_outcome, rows[name]
        assert rows[name]["fixed_logic_outcome"] == "not_reproduced"
    from kvdoctor.outcome_codes import exit_code_for_many

    reproduced = [row for row in doc["rows"] if row["outcome"] == "reproduced"]
    assert doc["any_reproduced"] is bool(reproduced)
    outcomes = [row["outcome"] for row in doc["rows"]] + [m["outcome"] for m in doc["metrics"]
                                                         if m["outcome"] != "measured"]
    assert proc.returncode == doc["exit_code"] == exit_code_for_many(outcomes), proc.stderr
    if k1_outcome == "reproduced":
        assert "fixed logic" in rows["queued-abort"]["hint"]


def test_audit_markdown_report(audit_run, home):
    _, doc, markdown = audit_run
    rows = {row["recipe"]: row for row in doc["rows"]}
    assert markdown.startswith("# kvdoctor audit: known KV-offload bugs on vLLM ")
    for key in ("kvdoctor", "vllm", "torch", "python", "os", "GPU present"):
        assert re.search(rf"^\| {key} \| .+ \|$", markdown, re.M), key
    table_rows = re.findall(r"^\| (K\d+|-) \| ([\w-]+) \|", markdown, re.M)
    assert {name for _, name in table_rows} == {row["recipe"] for row in doc["rows"]}
    assert "kvdoctor audit --json --report ~/audit.md" in markdown
    if rows["queued-abort"]["outcome"] == "reproduced":
        assert "`AssertionError: assert len(offload_keys) == len(offload_block_ids)`" in markdown
        assert "<details>" in markdown and "vLLM frames" in markdown


def test_reports_leak_no_secret_and_no_home(audit_run, home):
    _, _, markdown = audit_run
    assert SECRET not in markdown
    assert str(home) not in markdown
    assert os.path.expanduser("~") not in markdown or os.path.expanduser("~") == str(home)


@pytest.fixture(scope="module")
def repro_reports(api, home):
    paths = []
    for i in range(2):
        md, svg = home / f"repro{i}.md", home / f"repro{i}.svg"
        proc = invoke("repro", "queued-abort", "--report", str(md), "--svg", str(svg),
                       env={"HOME": str(home), "KVDOCTOR_SECRET_TOKEN": SECRET})
        assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr
        paths.append((md, svg))
    return paths


def test_repro_report_is_deterministic_but_for_timestamps(repro_reports):
    texts = [re.sub(r"_Generated .*_", "", md.read_text()).replace("repro1", "repro0")
             for md, _ in repro_reports]
    assert texts[0] == texts[1]
    text = texts[0]
    for section in ("## Environment", "## Command", "## Recipe", "## Setup", "## Outcome"):
        assert section in text
    assert "| installed |" in text and "| fixed |" in text and "| unpatched |" in text
    assert SECRET not in text


def test_svg_is_written(repro_reports):
    svg = repro_reports[0][1].read_text()
    assert svg.lstrip().startswith("<svg") and "queued-abort" in svg


@pytest.mark.parametrize("name", K1_RECIPES)
def test_exported_script_reproduces_with_vllm_only(tmp_path, name, k1_outcome):
    script = tmp_path / f"{name}.py"
    proc = invoke("repro", name, "--export-script", str(script))
    assert proc.returncode == 0, proc.stderr
    source = script.read_text()
    assert "kvdoctor" not in re.sub(r"^#.*$|\"\"\"[\s\S]*?\"\"\"", "", source, flags=re.M).replace(
        "kv-repro", ""), "the script must not import kvdoctor"
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""})
    if k1_outcome == "reproduced":
        assert run.returncode == 1, run.stdout + run.stderr
        assert "AssertionError" in run.stderr
        assert "assert len(offload_keys) == len(offload_block_ids)" in run.stderr
    else:
        assert run.returncode == 0, run.stdout + run.stderr
        assert "no crash" in run.stdout


def test_export_refuses_silent_bugs(api, tmp_path):
    recipe = tmp_path / "silent.toml"
    text = (ROOT / "repros" / "queued-abort.toml").read_text()
    head, rest = text.split("[signature]\n", 1)
    recipe.write_text(head + '[signature]\ninvariant = "store-covers-computed-slots"\n\n' + rest.split("\n\n", 1)[1])
    proc = invoke("repro", str(recipe), "--export-script", str(tmp_path / "x.py"))
    assert proc.returncode == 2 and "silent bug" in proc.stderr


def test_audit_measures_k10_against_a_baseline(audit_run):
    _, doc, markdown = audit_run
    (metric,) = [m for m in doc["metrics"] if m["bug"] == "K10"]
    assert metric["requests"] == 4 and metric["load_latency_steps"] == 2
    # Issue #44294 is open on every release in range: overlapping requests wait for the first load.
    assert metric["shared_steps"] > metric["baseline_steps"] >= 1
    assert metric["extra_steps"] == metric["shared_steps"] - metric["baseline_steps"]
    assert "## Measured (performance bugs)" in markdown and "| K10 |" in markdown


# The typical deployment (issue 13): the serve flags reach every recipe of the audit.
SERVE_FLAGS = ("--block-size", "16", "--num-gpu-blocks-override", "512", "--max-num-batched-tokens", "2048",
               "--max-num-seqs", "64", "--enable-chunked-prefill", "--async-scheduling",
               "--kv-offloading-size", "1")


def test_audit_runs_every_recipe_at_the_users_serve_flags(k1_outcome):
    proc = invoke("audit", "--json", *SERVE_FLAGS)
    doc = json.loads(proc.stdout)
    rows = {row["recipe"]: row for row in doc["rows"]}
    for name, row in rows.items():
        setup = row["setup"]
        assert (setup["block_size"], setup["gpu_blocks"], setup["max_num_batched_tokens"],
                setup["async_scheduling"]) == (16, 512, 2048, True), (name, setup)
        assert row["outcome"] in ("reproduced", "not_reproduced", "not_applicable", "untested"), (name, row)
        if row["outcome"] in ("not_applicable", "untested"):
            assert row["hint"], (name, f"{row['outcome']} without a reason")
    # A recipe scripted for its own CPU tier says so rather than "not reproduced" at a 1 GiB tier: untested
    # (issue 23: the user's flag prevents the trigger; never an exit-0 verdict), naming the flag.
    assert rows["swa-unaligned-pending-bound"]["outcome"] == "untested"
    assert "cpu_bytes_to_use" in rows["swa-unaligned-pending-bound"]["hint"]
    # The K1 recipes restated at any geometry give this release's K1 outcome at the user's flags too.
    for name in K1_RECIPES:
        assert rows[name]["outcome"] == k1_outcome, (name, rows[name]["hint"])
    outcomes = {r["outcome"] for r in rows.values()}
    assert proc.returncode == (1 if "reproduced" in outcomes else 6 if "untested" in outcomes else 0)
