"""`kvdoctor diagnose` on a start-up failure (issue 35): vLLM's start-up is run here at the log's serve
arguments (and the flags after `--`), as `kvdoctor check` runs it, and the log's failure is confirmed (exit 8)
or refuted ("starts here", with the reason it can be the host's).

The log is written the way vLLM writes one (`non-default args` with `KVTransferConfig(...)`'s repr, the
EngineCore's traceback), its exception and frame taken from the installed vLLM's own refusal of the same flags,
so the test follows the release rather than a copy of one release's message.
"""

from __future__ import annotations

import json

import pytest

from kvdoctor.check.flags import flags_from_serve_args

from .cli_runner import invoke
from .conftest import ROOT
from .test_check import CONFIGS, GIB, _check

pytestmark = pytest.mark.vllm

MODEL = str(CONFIGS / "llama-3.1-8b")
REFUSED = {"block_size": 16, "max_model_len": 2048, "num_gpu_blocks_override": 256}


def _log(tmp_path, extra_config: dict, refusal) -> str:
    """A vLLM 0.x serve log whose EngineCore died of `refusal` at start-up, with these serve arguments."""
    file, _, line = refusal.site.rpartition(":")
    transfer = ("KVTransferConfig(kv_connector='OffloadingConnector', engine_id='8c1f', kv_role='kv_both', "
                f"kv_connector_extra_config={extra_config!r}, kv_connector_module_path=None)")
    args = (f"{{'model': '{MODEL}', 'block_size': 16, 'max_model_len': 2048, 'num_gpu_blocks_override': 256, "
            f"'kv_transfer_config': {transfer}}}")
    core = "(EngineCore_DP0 pid=77) ERROR 12-05 10:00:09 [core.py:708] "
    text = "\n".join([
        "(APIServer pid=41) INFO 12-05 10:00:00 [api_server.py:1805] vLLM API server version 0.26.0",
        f"(APIServer pid=41) INFO 12-05 10:00:00 [utils.py:328] non-default args: {args}",
        core + "EngineCore failed to start.",
        core + "Traceback (most recent call last):",
        core + '  File "/usr/lib/python3.12/site-packages/'
        'vllm/v1/engine/core.py", line 699, in run_engine_core',
        core + "    engine_core = EngineCoreProc(*args, **kwargs)",
        core + f'  File "/usr/lib/python3.12/site-packages/{file}", line {line}, in build_offloading_config',
        core + "    assert tokens_per_chunk % tokens_per_block == 0",
        core + f"{refusal.exception}: {refusal.message}",
    ])
    path = tmp_path / "serve.log"
    path.write_text(text + "\n")
    return str(path)


@pytest.fixture(scope="module")
def refusal(api):
    """The installed vLLM's own refusal of an offloaded block 24 tokens long over 16-token GPU blocks."""
    result = _check(api, model=MODEL, block_size=16, max_model_len=2048, gpu_blocks=256,
                    kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": {"cpu_bytes_to_use": GIB, "block_size": 24}})
    if result.refusal is None or result.refusal.site is None:
        pytest.skip(f"vLLM {api.version_text} starts with a 24-token offloaded block over 16-token GPU blocks")
    return result.refusal


def test_a_logs_serve_arguments_are_the_checks_flags():
    args = {"model": "meta-llama/Llama-3.1-8B-Instruct", "block_size": "16", "enable_prefix_caching": False,
            "kv_transfer_config": {"__class__": "KVTransferConfig", "kv_connector": "OffloadingConnector",
                                   "kv_role": "kv_both", "engine_id": object(),
                                   "kv_connector_extra_config": {"cpu_bytes_to_use": GIB}},
            "kv_offloading_size": None}
    flags, notes = flags_from_serve_args(args)
    assert flags.block_size == 16 and flags.enable_prefix_caching is False and flags.model is None
    assert flags.kv_transfer_config == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": {"cpu_bytes_to_use": GIB}}
    assert any("meta-llama/Llama-3.1-8B-Instruct" in note and "tiny model" in note for note in notes)
    sized, _ = flags_from_serve_args({"kv_offloading_size": "4", "tensor_parallel_size": "2"})
    assert sized.kv_transfer_config["kv_connector_extra_config"]["cpu_bytes_to_use"] == 4 * GIB
    assert sized.tensor_parallel_size == 2


def test_the_logs_start_up_refusal_is_confirmed_here_exit_8(api, refusal, tmp_path):
    log = _log(tmp_path, {"cpu_bytes_to_use": GIB, "block_size": 24}, refusal)
    proc = invoke("diagnose", log, "--json")
    assert proc.returncode == 8, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    check = doc["startup_check"]
    assert check["verdict"] == "confirmed" and check["check"]["refusal"]["exception"] == refusal.exception
    assert check["flags_from"] == "the log's serve arguments"
    assert "block_size 32" in (check["check"]["refusal"]["fix"] or "")  # the flag change, run through the same path


def test_flags_after_the_double_dash_override_the_logs_and_a_start_refutes_it(api, refusal, tmp_path):
    log = _log(tmp_path, {"cpu_bytes_to_use": GIB, "block_size": 24}, refusal)
    fixed = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"cpu_bytes_to_use": GIB, "block_size": 32}})
    proc = invoke("diagnose", log, "--", "--kv-transfer-config", fixed)
    assert proc.returncode != 8, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Start-up, checked here" in proc.stdout and "not reproduced: vLLM starts here" in proc.stdout
    assert "the log's serve arguments and the flags given after --" in proc.stdout


def test_flags_after_the_double_dash_on_a_scheduler_crash_are_one_line_exit_2(tmp_path):
    log = ROOT / "tests" / "data" / "logs" / "vllm-51013-k1-tail.log"
    proc = invoke("diagnose", str(log), "--no-run", "--", "--block-size", "16")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "start-up failure" in lines[0], proc.stderr
