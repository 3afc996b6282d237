"""Nothing left behind (issue 34) and no second vLLM import (issue 33), as a user sees it: $TMPDIR and
~/.cache/vllm the same before and after `repro`, `repro --engine serve`, a SIGTERM mid-run and an exported
script; vLLM's model-info cache kept in kvdoctor's own cache directory (`kvdoctor cache`), and the exported
script's prompt back within 1 s of its last line.

Each process runs with its own empty $TMPDIR (short: a socket path must fit 107 bytes) and $HOME, and with
no cache variable set, as on a fresh shell. One `repro` fills kvdoctor's cache in that $HOME; the runs after
it find it (the model-info file is not rewritten: vLLM rewrites it only after inspecting the model again).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli_runner import invoke
from tests.conftest import KVDOCTOR, ROOT

from .conftest import exit_tail_limit

UNSET = ("KVDOCTOR_CACHE_DIR", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
         "VLLM_RPC_BASE_PATH", "KVDOCTOR_SCRATCH_DIR")


@dataclass
class Place:
    """A user's $HOME and $TMPDIR, empty at first, and the environment that points at them."""

    home: Path
    temp: Path
    env: dict[str, str]

    def listing(self) -> dict[str, list[str]]:
        """What a user would compare: `ls $TMPDIR` and `ls -R ~/.cache/vllm`."""
        vllm = self.home / ".cache" / "vllm"
        return {"tmp": sorted(p.name for p in self.temp.iterdir()),
                "vllm": sorted(str(p.relative_to(vllm)) for p in vllm.rglob("*")) if vllm.exists() else []}

    def model_infos(self) -> dict[str, int]:
        """kvdoctor's kept copies of vLLM's model-info cache: file -> modification time (ns)."""
        return {str(p.relative_to(self.home)): p.stat().st_mtime_ns
                for p in (self.home / ".cache" / "kvdoctor").glob("vllm-*/modelinfos/*.json")}


@pytest.fixture(scope="module")
def place():
    base = Path(tempfile.mkdtemp(prefix="kvd-lo-", dir="/tmp"))  # short: vLLM's sockets go under $TMPDIR
    home, temp = base / "h", base / "t"
    home.mkdir()
    temp.mkdir()
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(temp), "COLUMNS": "80"}
    for name in UNSET:
        env.pop(name, None)
    yield Place(home, temp, env)
    shutil.rmtree(base, ignore_errors=True)


@dataclass
class Ran:
    code: int
    out: str
    err: str
    tail: float  # seconds from the last byte of output to the process's end


def _run(cmd: list[str], env: dict[str, str], timeout: float = 600, until: Path | None = None) -> Ran:
    """Run `cmd`, reading stdout and stderr as they come; with `until`, SIGTERM it as soon as a
    `kvdoctor-model-*` folder (made after vLLM's import, removed at exit) shows in that folder."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    open_fds, last, deadline, sent = list(chunks), time.monotonic(), time.monotonic() + timeout, False
    try:
        while open_fds and time.monotonic() < deadline:
            ready, _, _ = select.select(open_fds, [], [], 0.1)
            for fd in ready:
                data = os.read(fd, 65536)
                if not data:
                    open_fds.remove(fd)
                    continue
                chunks[fd].append(data)
                last = time.monotonic()
            if until is not None and not sent and any(until.glob("kvdoctor-model-*")):
                proc.send_signal(signal.SIGTERM)
                sent = True
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    tail = time.monotonic() - last
    if until is not None:
        assert sent, "the run ended before kvdoctor's model folder showed"
    text = {fd: b"".join(parts).decode(errors="replace") for fd, parts in chunks.items()}
    return Ran(code, text[proc.stdout.fileno()], text[proc.stderr.fileno()], tail)


@pytest.fixture(scope="module")
def first_repro(place: Place) -> tuple[dict, Ran]:
    """The first run in that $HOME: vLLM inspects the model once and kvdoctor keeps the answer."""
    before = place.listing()
    ran = _run([*KVDOCTOR, "repro", "queued-abort", "--logic", "installed", "--worker", "simulated"], place.env)
    return before, ran


def test_repro_leaves_nothing_and_keeps_vllms_model_info_in_kvdoctors_cache(place, first_repro):
    before, ran = first_repro
    assert ran.code in (0, 1), ran.err
    assert place.listing() == before == {"tmp": [], "vllm": []}
    infos = place.model_infos()
    assert any(name.endswith("LlamaForCausalLM.json") for name in infos), infos  # ~/.cache/kvdoctor/vllm-X/...
    assert [p.name for p in place.home.iterdir()] == [".cache"]
    assert [p.name for p in (place.home / ".cache").iterdir()] == ["kvdoctor"]
    assert ran.tail < exit_tail_limit(), f"the process ended {ran.tail:.2f}s after its last output"


def test_sigterm_mid_run_stops_cleans_up_and_exits_143_with_one_line(place, first_repro):
    infos = place.model_infos()
    before = place.listing()
    ran = _run([*KVDOCTOR, "audit", "--json"], place.env, until=place.temp)
    assert ran.code == 143, (ran.code, ran.err[-2000:])
    # kvdoctor's one line, last; before it at most vLLM's own log lines (a SIGTERM inside vLLM's config parsing
    # logs its "Error parsing config ..., retrying"), never a traceback
    lines = ran.err.strip().splitlines()
    assert lines[-1] == "kvdoctor: error: terminated (SIGTERM): the run was stopped", ran.err
    assert all(not line.startswith("kvdoctor") and "Traceback" not in line for line in lines[:-1]), ran.err
    document = json.loads(ran.out)
    assert document["error"] == {"kind": "terminated", "message": "terminated (SIGTERM): the run was stopped",
                                 "exit_code": 143}
    assert place.listing() == before
    assert place.model_infos() == infos


@pytest.mark.vllm
def test_serve_level_leaves_no_socket_and_reuses_the_model_info(place, first_repro, serve_env):
    infos = place.model_infos()
    before = place.listing()
    env = {**place.env, "PYTHONPATH": serve_env.get("PYTHONPATH", place.env.get("PYTHONPATH", ""))}
    ran = _run([*KVDOCTOR, "repro", "queued-abort", "--engine", "serve"], env, timeout=900)
    assert ran.code in (0, 1), ran.err[-3000:]
    assert place.listing() == before, "the server's ZMQ sockets (or anything else) were left in $TMPDIR"
    assert place.model_infos() == infos, "the server's processes inspected the model again"


@pytest.fixture(scope="module")
def exported(place: Place, tmp_path_factory: pytest.TempPathFactory) -> Path:
    script = tmp_path_factory.mktemp("export") / "repro_queued_abort.py"
    proc = invoke("repro", "queued-abort", "--export-script", str(script))
    assert proc.returncode == 0, proc.stderr
    return script


def test_exported_script_leaves_nothing_and_exits_within_a_second_of_its_last_line(place, exported):
    before = place.listing()
    home_before = sorted(str(p) for p in place.home.rglob("*"))
    ran = _run([sys.executable, str(exported)], place.env)
    assert ran.code in (0, 1), ran.out[-2000:] + ran.err[-2000:]  # 1: the engine's crash (0.26), 0: fixed (0.34)
    assert ("AssertionError" in ran.err) == (ran.code == 1), ran.err[-2000:]
    assert place.listing() == before
    assert sorted(str(p) for p in place.home.rglob("*")) == home_before
    assert ran.tail < exit_tail_limit(), f"the script ended {ran.tail:.2f}s after its last line"


# -- kvdoctor's cache directory, without vLLM ------------------------------------------------------------------

def test_the_cache_directory_is_kvdoctors_own_and_documented(monkeypatch, tmp_path):
    from kvdoctor import user_cache

    for name in UNSET:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert user_cache.cache_dir() == tmp_path / ".cache" / "kvdoctor"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache.cache_dir() == tmp_path / "xdg" / "kvdoctor"
    monkeypatch.setenv("KVDOCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert user_cache.cache_dir() == tmp_path / "mine"
    user_cache.keep_vllm_cache()
    root = Path(os.environ["VLLM_CACHE_ROOT"])
    assert root.parent == tmp_path / "mine" and root.name.startswith("vllm-")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "theirs"))  # the user's own stays theirs
    user_cache.keep_vllm_cache()
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "theirs")


def test_cache_command_shows_where_and_how_big_and_clears_only_its_own(tmp_path):
    entry = tmp_path / "vllm-0.0.0" / "modelinfos"
    entry.mkdir(parents=True)
    (entry / "x.json").write_text("{}" * 50)
    (tmp_path / "not-kvdoctors.txt").write_text("keep me")
    env = {"KVDOCTOR_CACHE_DIR": str(tmp_path), "KVDOCTOR_BYTECODE_CACHE": "0"}  # only the model-info entry
    shown = invoke("cache", env=env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0] == f"kvdoctor's cache: {tmp_path} (1 file, 100 bytes)"
    assert "kvdoctor cache --clear" in shown.stdout and "KVDOCTOR_CACHE_DIR" in shown.stdout
    cleared = invoke("cache", "--clear", "--json", env=env)
    assert cleared.returncode == 0, cleared.stderr
    assert json.loads(cleared.stdout)["cache"] == {"path": str(tmp_path), "files": 1, "size_bytes": 100,
                                                   "cleared": True, "env": "KVDOCTOR_CACHE_DIR"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-kvdoctors.txt"]


def _bytecode_kept(tmp_path: Path, **env: str) -> tuple[bool, list[str]]:
    """A fresh interpreter told to write no bytecode calls `keep_bytecode`, then imports a module of its own:
    (what keep_bytecode returned, the .pyc files written anywhere under tmp_path)."""
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    (source / "kvd_probe_mod.py").write_text("VALUE = 1\n")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", *UNSET)}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from kvdoctor.user_cache import keep_bytecode; "
            "kept = keep_bytecode(); import kvd_probe_mod; print(kept)")
    ran = subprocess.run([sys.executable, "-c", code, str(source)], capture_output=True, text=True, cwd=ROOT,
                         env={**base, "PYTHONDONTWRITEBYTECODE": "1", "KVDOCTOR_CACHE_DIR": str(tmp_path / "c"),
                              **env}, timeout=60)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout.strip() == "True", sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.pyc"))


def test_bytecode_is_kept_in_kvdoctors_cache_never_beside_the_sources(tmp_path):
    from kvdoctor.user_cache import vllm_compiled_beside

    if vllm_compiled_beside():
        pytest.skip("this vLLM's package holds its compiled bytecode: kvdoctor keeps none of its own")
    kept, written = _bytecode_kept(tmp_path)
    assert kept and written and all(p.startswith("c/pycache/") and p.endswith("kvd_probe_mod.cpython-"
                                                                            f"{sys.version_info[0]}"
                                                                            f"{sys.version_info[1]}.pyc")
                                    for p in written), written
    shutil.rmtree(tmp_path / "c")
    assert _bytecode_kept(tmp_path, KVDOCTOR_BYTECODE_CACHE="0") == (False, [])  # the user's setting stands


def test_a_socket_folder_too_long_for_a_socket_path_keeps_vllms_default(tmp_path):
    from kvdoctor.clean_exit import throwaway_paths

    short: dict[str, str] = {"VLLM_CACHE_ROOT": "/mine"}
    throwaway_paths("/tmp/kvd-x", short)
    assert short == {"VLLM_CACHE_ROOT": "/mine", "TORCHINDUCTOR_CACHE_DIR": "/tmp/kvd-x/torchinductor_cache_dir",
                     "TRITON_CACHE_DIR": "/tmp/kvd-x/triton_cache_dir", "VLLM_RPC_BASE_PATH": "/tmp/kvd-x",
                     "TMPDIR": "/tmp/kvd-x"}
    long: dict[str, str] = {}
    throwaway_paths("/" + "x" * 80, long, temp=False)
    assert "VLLM_RPC_BASE_PATH" not in long and "TMPDIR" not in long
