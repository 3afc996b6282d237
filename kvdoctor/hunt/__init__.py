"""`kvdoctor hunt LOG`: an unknown crash in a vLLM log turned into a search for a route to its site.

`aim` reads what to aim at from the log (diagnose's reader: the crash's exception, function and statement,
the features the log names) and the flags; `app` runs explore aimed there, with the line coverage of the
crash's function, and says what it found or how near it came. Import-light: vLLM and hypothesis are
imported by `app` when it runs.
"""

from __future__ import annotations

DEFAULT_TIME_BUDGET = 600.0  # seconds of hunting after vLLM's import (search, shrinking and triage)
DEFAULT_OUT = "kvdoctor-hunt"
