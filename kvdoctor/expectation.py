"""What an `expect` step asks of one request, against what was observed: one definition for kvdoctor's
scenario (`steps.check_expectation`) and for the exported scripts, which copy this module in on export
(stdlib only: it imports neither kvdoctor nor vLLM).

`observed` holds what the caller can see of the request: `status` (vLLM's RequestStatus name),
`allocated_blocks`, `in_flight_jobs`, `connector_state` ("present" / "released") and, where the caller
counts them, `store_jobs_built`. A key the caller cannot see is never compared.
"""

from collections.abc import Mapping
from typing import Any

# (the step's key, the observed quantity, exact (==) or a lower bound (>=))
COMPARISONS = (
    ("allocated_blocks", "allocated_blocks", True), ("min_allocated_blocks", "allocated_blocks", False),
    ("in_flight_jobs", "in_flight_jobs", True), ("min_in_flight_jobs", "in_flight_jobs", False),
    ("store_jobs_built", "store_jobs_built", True), ("min_store_jobs_built", "store_jobs_built", False),
)


def unmet(args: Mapping[str, Any], observed: Mapping[str, Any]) -> list[str]:
    """Each way `observed` misses what `args` expects ("allocated_blocks 3, expected 4"); empty when it holds."""
    problems = []
    statuses = args.get("status")
    wanted = [statuses] if isinstance(statuses, str) else statuses
    if wanted and observed["status"] not in wanted:
        problems.append(f"status {observed['status']}, expected {wanted}")
    for key, quantity, exact in COMPARISONS:
        if key not in args or quantity not in observed:
            continue
        value = observed[quantity]
        if not (value == args[key] if exact else value >= args[key]):
            problems.append(f"{quantity} {value}, expected {'' if exact else 'at least '}{args[key]}")
    if "connector_state" in args and args["connector_state"] != observed["connector_state"]:
        problems.append(f"connector state {observed['connector_state']}, expected {args['connector_state']}")
    return problems
