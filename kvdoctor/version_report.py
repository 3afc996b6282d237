"""`kvdoctor version`: the versions and adapter probes a bug report needs (like `vllm collect-env`).

An application function: it imports vLLM (through the adapter), runs every feature probe, the
worker side's included, and returns what it found; `kvdoctor.report.version` formats it.
"""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass, field
from typing import Any

from kvdoctor import __version__
from kvdoctor.engine import compat
from kvdoctor.engine.compat import probes
from kvdoctor.errors import ExitStatus, IncompatibleVllmError, VllmUnavailableError
from kvdoctor.installed import distribution_version


@dataclass
class VersionReport:
    kvdoctor: str
    python: str
    platform: str
    vllm: str | None  # as the installed vLLM reports it (its metadata where it cannot be imported)
    torch: str | None
    probes: list[Any] = field(default_factory=list)  # compat.probes.ProbeResult, in the adapter's order
    problem: str | None = None  # why vLLM could not be checked at all (missing, broken, too old)
    note: str | None = None  # a release newer than the newest measured one

    @property
    def all_probes_hold(self) -> bool:
        return self.problem is None and all(p.holds for p in self.probes)

    @property
    def exit_code(self) -> int:
        """0 when vLLM imports and every probe holds; 3 (vLLM missing/broken/incompatible) otherwise."""
        return 0 if self.all_probes_hold else int(ExitStatus.VLLM_UNAVAILABLE)

    def as_dict(self) -> dict[str, Any]:
        return {"kvdoctor": self.kvdoctor, "python": self.python, "platform": self.platform,
                "vllm": self.vllm, "torch": self.torch, "problem": self.problem, "note": self.note,
                "probes": [p.as_dict() for p in self.probes],
                "all_probes_hold": self.all_probes_hold, "exit_code": self.exit_code}


def version_report() -> VersionReport:
    """Import vLLM and answer every probe; a probe that fails is listed with the others, not raised."""
    report = VersionReport(kvdoctor=__version__, python=f"{platform.python_version()} ({sys.executable})",
                           platform=platform.platform(), vllm=compat.installed_vllm_version(), torch=None)
    try:
        api = compat.load()
    except IncompatibleVllmError:  # a scheduler-side probe failed: list every probe's answer below
        api = compat.import_vllm()
    except VllmUnavailableError as exc:
        report.problem = str(exc)
        report.torch = distribution_version("torch")
        return report
    report.vllm = api.version_text
    report.torch = distribution_version("torch")
    report.note = compat.newer_release_note(api.version_text, api.version)
    report.probes = probes.run(api, worker_side=True)
    return report
