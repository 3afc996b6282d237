"""One engine step as vLLM's engine core takes it, and the tokens the scheduled requests sample.

The one definition of the step loop: kvdoctor's scheduler harness (`engine/harness.py`) runs it, and
a script exported with `--export-script` gets this module's code copied in on export
(`compat.inline_portable`). Hence no kvdoctor import, no vLLM import and no `from __future__` here.
"""

from collections.abc import Callable
from typing import Any

EOS_TOKEN = 2  # the token a request stops at (its sampling params' stop_token_ids)
DECODE_TOKEN = 7  # every other sampled token


class StepLoop:
    """schedule(), the worker side's output for it, update_from_output(). Under async scheduling the
    output is applied one step late (the batch in flight), and `drain` applies it as an engine that
    goes idle does."""

    def __init__(self, scheduler: Any, async_scheduling: bool) -> None:
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling
        self.pending: tuple[Any, Any] | None = None  # async: the last step's output, not yet applied

    def step(self, worker_side: Callable[[Any], Any]) -> Any:
        """One step; `worker_side(scheduler_output)` returns its ModelRunnerOutput. Returns the output."""
        output = self.scheduler.schedule()
        runner_output = worker_side(output)
        if self.async_scheduling:
            previous, self.pending = self.pending, (output, runner_output)
            if previous is not None:
                self.scheduler.update_from_output(*previous)
        else:
            self.scheduler.update_from_output(output, runner_output)
        return output

    def drain(self) -> bool:
        """Apply the output still in flight (async scheduling); False when there is none."""
        if self.pending is None:
            return False
        pending, self.pending = self.pending, None
        self.scheduler.update_from_output(*pending)
        return True


def sample(requests: dict[str, Any], scheduled: Any, finish_next: set[str],
           accepted: Callable[[str], int] | None = None) -> dict[str, list[int]]:
    """The tokens each scheduled request samples. None mid-prefill; once every known token is computed,
    EOS where a recipe finishes it (`finish_next`, then forgotten), else DECODE_TOKEN, after the drafts
    the stand-in rejection sampler accepts (`accepted(req_id)`, asked only for a sampling request)."""
    sampled: dict[str, list[int]] = {}
    for req_id in scheduled:
        request = requests.get(req_id)
        if request is not None and request.num_computed_tokens >= request.num_tokens:
            token = EOS_TOKEN if req_id in finish_next else DECODE_TOKEN
            finish_next.discard(req_id)
            drafts = accepted(req_id) if accepted is not None else 0
            sampled[req_id] = [DECODE_TOKEN] * drafts + [token]
        else:
            sampled[req_id] = []
    return sampled
