"""`kvdoctor explore`: generated event sequences against vLLM's real scheduler.

Hypothesis draws a serving geometry and a list of events (add requests, with
shared prefixes; schedule; abort; finish by EOS; hold / complete / fail
transfers; reset the prefix cache), `generate` turns them into an ordinary
`Recipe` (valid by construction), `runner` runs it with
`kvdoctor.levels.scheduler.run_scenario` under every named invariant and classifies
what broke, `search` drives `hypothesis.find` once per new failure signature
(hypothesis both finds and shrinks), and `findings` writes each shrunk failure
as a recipe file that `kvdoctor repro FILE` replays.

This module stays import-light (the CLI reads the defaults below for --help):
hypothesis and vLLM are imported by the submodules, inside the command.
"""

from __future__ import annotations

DEFAULT_SEED = 0
DEFAULT_MAX_EXAMPLES = None  # no limit: the time budget decides
DEFAULT_TIME_BUDGET = 30.0  # seconds of exploring, after vLLM is imported
DEFAULT_MAX_EVENTS = 24  # events per generated sequence (before the settle tail)
DEFAULT_OUT = "kvdoctor-findings"
