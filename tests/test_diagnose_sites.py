"""The crash statements kvdoctor matches logs against are what the installed release's source writes.

`kvdoctor/data/crash_statements.toml` is written by `python -m kvdoctor.diagnose.sites` from each
release's installed source; this re-reads the vLLM installed here (with `ast`, no import) and
checks its rows, so a hand edit or a stale file fails.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvdoctor.diagnose import sites
from kvdoctor.diagnose.statement import compare, tokenize
from kvdoctor.matrix import data
from kvdoctor.recipes.builtins import all_builtins


def _site_packages() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed here: nothing to re-measure")
    return Path(next(iter(spec.submodule_search_locations))).parent


def test_the_data_file_is_what_the_installed_release_writes():
    site_packages = _site_packages()
    release = sites.installed_release(site_packages)
    stored = [s for s in sites.load() if s.release == release]
    if not stored:
        pytest.skip(f"crash_statements.toml has no rows for the installed vLLM {release}: measure it")
    measured = sites.measure_release(site_packages, all_builtins(), data.load())
    assert sorted(measured, key=repr) == sorted(stored, key=repr)


def test_the_data_file_renders_back_to_itself():
    text = sites.DATA_FILE.read_text()
    assert sites.render(sites.load()) == text


@pytest.mark.parametrize(("shown", "known", "kind"), [
    ("assert len(offload_keys) == len(offload_block_ids)", "assert len(offload_keys) == len(offload_block_ids)",
     "exact"),
    ("assert (\n num_pending_gpu_blocks\n <= sliding_window_size_in_blocks * block_size_factor\n)",
     "assert (\n num_pending_gpu_blocks\n <= group_config.sliding_window_size_in_chunks\n"
     " * self.config.blocks_per_chunk\n + 1\n)", "renamed"),
    ("num_locally_computed_tokens", "assert (\n num_locally_computed_tokens\n <= num_locally_computed_gpu_blocks * "
     "tokens_per_block\n)", "partial"),
    ("assert (", "assert (\n num_locally_computed_tokens\n)", None),  # names nothing
    ("assert num_pending_gpu_blocks <= sliding_window_size_in_blocks * block_size_factor",
     "assert (\n num_locally_computed_tokens\n <= num_locally_computed_gpu_blocks * tokens_per_block\n)", None),
    ("assert len(offload_keys) >= num_chunks", "assert len(offload_keys) == len(offload_block_ids)", None),
])
def test_statements_compare_structurally(shown, known, kind):
    likeness = compare(shown, known)
    assert (likeness.kind if likeness else None) == kind


def test_attribute_chains_count_by_their_last_name():
    assert tokenize("assert self.config.blocks_per_chunk == x.y").text == "blocks_per_chunk == y"
