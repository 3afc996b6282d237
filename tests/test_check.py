"""`kvdoctor check`: vLLM's own start-up path at serve flags, on this CPU (issue 35).

Each refusal is vLLM's, raised by the installed release's start-up code (or, for a CPU tier larger than the
host, predicted from the sizes vLLM's spec computed) and named with its file:line; the flag change offered
is run through the same path and starts. Where a release has no such refusal, the test skips, saying so.
"""

from __future__ import annotations

import json

import pytest

from kvdoctor.check.app import check, exit_status
from kvdoctor.check.flags import CheckFlags, parse_size
from kvdoctor.engine.overrides import Overrides
from kvdoctor.errors import ExitStatus, UsageError

from .conftest import ROOT

pytestmark = pytest.mark.vllm

CONFIGS = ROOT / "tests" / "data" / "configs"
GIB = 1 << 30


def _offloading(cpu_bytes: int, **extra: object) -> dict[str, object]:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, **extra}}


def _check(api, **flags: object):
    return check(CheckFlags(**flags), lambda: Overrides(), command="kvdoctor check (test)", audit=False)


def _source_has(api, needle: str) -> bool:
    from kvdoctor.engine.compat.startup import build_offloading_config_source

    return needle in (build_offloading_config_source() or "")


@pytest.mark.parametrize("name, flags", [
    ("the README's default (no flags)", {}),
    ("Llama-3.1-8B, a 8 GiB CPU tier", {"model": str(CONFIGS / "llama-3.1-8b"), "block_size": 16,
                                        "max_model_len": 8192, "kv_transfer_config": _offloading(8 * GIB)}),
    ("Qwen3-0.6B, a 4 GiB CPU tier, chunks of 64 tokens", {
        "model": str(CONFIGS / "qwen3-0.6b"), "kv_transfer_config": _offloading(4 * GIB, block_size=64)}),
    ("Qwen3-Next (hybrid), a 2 GiB CPU tier", {"model": str(CONFIGS / "qwen3-next-80b-a3b"), "max_model_len": 2048,
                                               "gpu_blocks": 256, "kv_transfer_config": _offloading(2 * GIB)}),
])
def test_real_deployments_start(api, name, flags):
    result = _check(api, **flags)
    assert result.refusal is None, (name, result.refusal)
    assert result.verdict == "starts" and exit_status(result) == ExitStatus.NOT_REPRODUCED
    names = [stage.name for stage in result.stages]
    assert names[:2] == ["config", "planning"] and names[-1] == "scheduler", names
    if "kv_transfer_config" in flags:
        assert "offloading" in names and result.region_bytes and result.region_bytes <= 8 * GIB


def test_an_offloaded_block_not_a_multiple_of_the_gpu_block_is_refused_and_the_fix_starts(api):
    """offloading/config.py: `assert tokens_per_chunk_int % tokens_per_block == 0` (0.26.0), a ValueError
    naming the multiple to use on later releases."""
    result = _check(api, model=str(CONFIGS / "llama-3.1-8b"), block_size=16, max_model_len=2048, gpu_blocks=256,
                    kv_transfer_config=_offloading(GIB, block_size=24))
    refusal = result.refusal
    assert refusal is not None and refusal.stage == "offloading" and not refusal.predicted
    assert refusal.exception in ("AssertionError", "ValueError")
    assert refusal.site
    assert refusal.site.startswith("vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py:")
    assert "tokens_per_chunk" in refusal.message or "multiple of the GPU KV cache block size" in refusal.message
    assert refusal.fix is not None and "block_size 32" in refusal.fix and refusal.fix_checked
    assert exit_status(result) == ExitStatus.STARTUP_REFUSED


def test_a_hash_block_the_groups_block_does_not_divide_is_refused(api):
    """offloading/config.py: `assert tokens_per_block % tokens_per_hash == 0` ("Hybrid models need
    --enable-prefix-caching"): Qwen3-Next without prefix caching plans the Mamba state's block as the hash block."""
    if not _source_has(api, "% tokens_per_hash == 0"):
        pytest.skip("this release's build_offloading_config has no tokens_per_hash assert")
    result = _check(api, model=str(CONFIGS / "qwen3-next-80b-a3b"), enable_prefix_caching=False, max_model_len=2048,
                    gpu_blocks=256, kv_transfer_config=_offloading(GIB))
    refusal = result.refusal
    if refusal is None:
        pytest.skip("this release plans Qwen3-Next without prefix caching with one block size: nothing to refuse")
    assert refusal.exception == "AssertionError" and "tokens_per_hash" in refusal.message
    assert refusal.site and "/offloading/config.py:" in refusal.site
    assert refusal.fix == "--enable-prefix-caching" and refusal.fix_checked


@pytest.mark.parametrize("host", ["32GiB", None])
def test_a_cpu_tier_beyond_the_hosts_memory_is_refused_with_the_size_that_fits(api, host):
    from kvdoctor.engine.memory import physical_memory_bytes

    size = 64 * GIB if host else 2 * (physical_memory_bytes() or 0) + 64 * GIB
    result = _check(api, model=str(CONFIGS / "llama-3.1-8b"), block_size=16, max_model_len=2048, gpu_blocks=256,
                    kv_transfer_config=_offloading(size),
                    host_memory=parse_size("--host-memory", host) if host else None)
    refusal = result.refusal
    assert refusal is not None and refusal.stage == "host" and refusal.predicted, refusal
    assert result.host_source == ("--host-memory" if host else "MemTotal")
    assert refusal.site and refusal.site.startswith("vllm/v1/kv_offload/cpu/"), refusal.site
    assert refusal.fix and refusal.fix.startswith("--kv-offloading-size ") and refusal.fix_checked
    if host:
        assert refusal.fix.startswith("--kv-offloading-size 25 ")
        both = _check(api, model=str(CONFIGS / "llama-3.1-8b"), block_size=16, max_model_len=2048, gpu_blocks=256,
                      kv_transfer_config=_offloading(20 * GIB), data_parallel_size=2,
                      host_memory=parse_size("--host-memory", host))
        assert both.refusal is not None and "2 data-parallel engines" in both.refusal.message


def test_sizes_and_json_flags_are_read_or_refused_in_one_line():
    assert parse_size("--host-memory", "64GiB") == 64 * GIB == parse_size("--host-memory", "64G")
    assert parse_size("--host-memory", "512M") == 512 << 20
    with pytest.raises(UsageError, match="--host-memory"):
        parse_size("--host-memory", "lots")


def test_the_cli_exits_with_the_start_up_code_and_says_which_flag_avoids_it(api):
    from .cli_runner import invoke

    config = json.dumps(_offloading(GIB, block_size=24))
    proc = invoke("check", "--model", str(CONFIGS / "llama-3.1-8b"), "--block-size", "16", "--max-model-len", "2048",
                  "--num-gpu-blocks-override", "256", "--kv-transfer-config", config, "--no-audit", "--json")
    assert proc.returncode == ExitStatus.STARTUP_REFUSED == 8, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["verdict"] == "refused" and doc["exit_code"] == 8
    assert "block_size 32" in doc["refusal"]["fix"] and doc["known_bugs"] is None
    text = invoke("check", "--model", str(CONFIGS / "llama-3.1-8b"), "--kv-offloading-size", "1", "--no-audit")
    assert text.returncode == 0 and text.stdout.startswith("Start-up\nstarts:"), text.stdout


def test_the_known_bugs_at_the_flags_are_the_audits_rows(api):
    """Starts, then the audit's rows at the same flags: the crashes kvdoctor measured reproducing on this release
    (kvdoctor/data/release_outcomes.toml) reproduce here too, and then the exit status is 1."""
    from kvdoctor.matrix import data

    measured = {row.recipe for row in data.load() if row.release == api.version_text.split()[0]
                and row.outcome == "reproduced" and not (row.failure_site or "").startswith("invariant")}
    if not measured:
        pytest.skip(f"no crash measured reproducing on vLLM {api.version_text}")
    result = check(CheckFlags(), lambda: Overrides(worker="simulated"), command="kvdoctor check", audit=True)
    assert result.audit is not None
    reproduced = {row.recipe.name for row in result.reproduced_bugs()}
    assert measured <= reproduced, measured - reproduced
    assert exit_status(result) == ExitStatus.REPRODUCED
