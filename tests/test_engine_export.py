"""`--export-script FILE --engine serve`: a script a maintainer runs without kvdoctor.

Running the script takes a whole `vllm serve` start-up (~45-100 s on 2 cores), so this suite
checks its text (cheap): the script and the two stand-ins it writes import only vLLM and the
standard library, and they carry kvdoctor's own serve-level flags and traffic.
`benchmarks/bench_engine.py export` runs the script and compares its exit with kvdoctor's verdict
(measured: exit 1 on vLLM 0.26.0, 0 on 0.34.0).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import sys

import pytest

from kvdoctor.engine.overrides import Overrides
from tests.conftest import run_cli

ALLOWED = set(sys.stdlib_module_names) | {"vllm", "__future__"}


def _imports(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add((node.module or "").split(".")[0])
    return names


def _assigned(tree: ast.Module, name: str) -> str:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"the script assigns no {name}")


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("export") / "queued_abort_serve.py"
    proc = run_cli("repro", "queued-abort", "--engine", "serve", "--export-script", str(path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return path.read_text()


def test_the_script_and_its_stand_ins_import_only_vllm_and_the_standard_library(script: str) -> None:
    tree = ast.parse(script)
    assert _imports(tree) <= set(sys.stdlib_module_names), _imports(tree) - set(sys.stdlib_module_names)
    for name in ("PLATFORM_SOURCE", "EXECUTOR_SOURCE"):
        source = ast.parse(_assigned(tree, name))
        assert "vllm" in _imports(source)
        assert _imports(source) <= ALLOWED, (name, _imports(source) - ALLOWED)


def test_the_stand_ins_are_vllms_extension_points(script: str) -> None:
    tree = ast.parse(script)
    platform = _assigned(tree, "PLATFORM_SOURCE")
    assert "class KvdoctorCpuPlatform(Platform)" in platform and "def register()" in platform
    assert 'os.environ.get("KVREPRO_STANDIN") != "1"' in platform  # declines unless the script asked
    executor = _assigned(tree, "EXECUTOR_SOURCE")
    assert "class StandInExecutor(Executor)" in executor
    assert "def default_kv_cache_layouts" in executor  # the adapter's one definition, copied in
    assert "[vllm.platform_plugins]" in script and "kvrepro_standin.executor.StandInExecutor" in script
    from kvdoctor.levels.serve_client import STEP_LOG_PREFIX  # the step log the serve client reads

    assert f'STEP_LOG_PREFIX = "{STEP_LOG_PREFIX}"' in executor and f'STEP_LOG_PREFIX = "{STEP_LOG_PREFIX}"' in script


def test_the_script_plays_kvdoctors_serve_level(script: str) -> None:
    """The same flags (less host/port/executor, which the script picks) and traffic as `--engine serve`."""
    from kvdoctor.levels import serve
    from kvdoctor.recipes.builtins import resolve
    from kvdoctor.resolution import resolve_setup

    recipe = resolve("queued-abort")
    assignment = next(node for node in ast.parse(script).body
                      if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "RECIPE")
    data = json.loads(assignment.value.args[0].value)  # RECIPE = json.loads(r"""...""")
    setup = serve.serve_setup(resolve_setup(recipe, Overrides(engine="serve")))
    assert [e["kind"] for e in data["events"]] == [e.kind for e in serve.plan_traffic(recipe, setup)]
    assert data["aborted"] == ["B"]
    assert "--distributed-executor-backend" not in data["serve_args"] and "--port" not in data["serve_args"]
    assert data["serve_args"][data["serve_args"].index("--num-gpu-blocks-override") + 1] == str(setup.gpu_blocks)
    # the connector's config as the serve level passes it, its CPU tier in the served model's bytes (served_tiers)
    from kvdoctor.engine.tiny_model import tiny_model_dir

    command = serve.serve_command(setup, tiny_model_dir(), 0)
    flag = "--kv-transfer-config"
    assert json.loads(data["serve_args"][data["serve_args"].index(flag) + 1]) == json.loads(
        command[command.index(flag) + 1])
    assert data["signature"] == {"exception": "AssertionError", "function": "_build_store_jobs", "invariant": None}
    assert data["reference_args"] is None  # a crash: one server


@pytest.mark.parametrize("args, words", [
    (("preemption", "--engine", "serve"), "`hold_transfers` cannot be played through vllm serve"),
    (("queued-abort", "--engine", "core"), "--engine core has no exported form"),
])
def test_an_unexportable_level_is_one_line_exit_2(tmp_path, args, words) -> None:
    proc = run_cli("repro", *args, "--export-script", str(tmp_path / "x.py"), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], proc.stderr
    assert not (tmp_path / "x.py").exists()


def test_a_silent_bugs_script_compares_its_clients_answers_with_an_offloading_off_server(tmp_path) -> None:
    """K4's script: the same serve-level flags with and without the connector, and the executor's KV keys and
    answer (kvdoctor's one definition, copied in). Measured by running it (`benchmarks/bench_engine.py export
    final-token-slot-stored`): exit 1 on vLLM 0.26.0 (C differs at token 0), 0 on 0.34.0, no process or socket left."""
    from kvdoctor.levels import serve
    from kvdoctor.recipes.builtins import resolve
    from kvdoctor.resolution import resolve_setup

    path = tmp_path / "k4_serve.py"
    proc = run_cli("repro", "final-token-slot-stored", "--engine", "serve", "--export-script", str(path), timeout=120)
    assert proc.returncode == 0, proc.stderr
    tree = ast.parse(path.read_text())
    assert _imports(tree) <= set(sys.stdlib_module_names)
    data = json.loads(next(node for node in tree.body if isinstance(node, ast.Assign)
                           and getattr(node.targets[0], "id", "") == "RECIPE").value.args[0].value)
    recipe = resolve("final-token-slot-stored")
    setup = serve.serve_setup(resolve_setup(recipe, Overrides(engine="serve")))
    assert "--kv-transfer-config" in data["serve_args"] and "--kv-transfer-config" not in data["reference_args"]
    assert [a for a in data["serve_args"] if a != "--kv-transfer-config" and not a.startswith("{")] == \
        data["reference_args"]
    assert [e["request"] for e in data["events"] if e["kind"] == "add"] == ["A", "C"]
    assert data["events"] == [dataclasses.asdict(e) for e in serve.plan_traffic(recipe, setup)]
    executor = ast.parse(_assigned(tree, "EXECUTOR_SOURCE"))
    assert _imports(executor) <= ALLOWED
    defined = {node.name for node in executor.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}
    assert {"StandInExecutor", "StandInKv", "answer_of", "next_key", "spec_block_ids"} <= defined


def test_k9s_script_carries_the_executor_plan_and_a_multiconnector() -> None:
    """K9's script (no server run here): its stand-in plays the serve level's executor plan (A's store held
    from engine step 1, completed later) under the serve level's MultiConnector --kv-transfer-config. Measured
    by running the script (docs/engine-levels.md): exit 1 on vLLM 0.26.0 (D differs at token 0: 599 where the
    reference has 332), 0 on 0.34.0."""
    from kvdoctor.export.script import serve_recipe_data
    from kvdoctor.levels import serve
    from kvdoctor.recipes.builtins import resolve
    from kvdoctor.resolution import resolve_setup

    recipe = resolve("reused-block-unfenced-multiconnector")
    setup = resolve_setup(recipe, Overrides(engine="serve"))
    data = serve_recipe_data(recipe, setup)
    plan = serve.executor_plan(recipe, serve.serve_setup(setup))
    assert data["plan"] == plan
    assert [(e["action"], e["request"], e["kind"]) for e in plan] == [("hold", "A", "store"),
                                                                      ("complete", None, None)]
    flag = "--kv-transfer-config"
    config = json.loads(data["serve_args"][data["serve_args"].index(flag) + 1])
    assert config["kv_connector"] == "MultiConnector"
    assert [c["kv_connector"] for c in config["kv_connector_extra_config"]["connectors"]] == ["OffloadingConnector"] * 2
    assert flag not in data["reference_args"]  # the reference: offloading off, no connector at all
