"""The 0.33.0 P2P candidate (issue 36): after the consumer aborts mid-round, how long does the producer pin it?

Plays `P2PPlan(delay_polls=3, abort_consumer_at=4)` on the installed vLLM with the probe bypassed (0.33.0 is not a
supported P2P run: its tier's has_pending_work() is always True), then moves vLLM's P2P clock ahead
(compat/p2p_clock.py) and prints, after three steps at each offset, the P2P jobs each side still holds.

    PYTHONPATH=$PWD /work/main/.venv-vllm-0.33/bin/python benchmarks/p2p_abort_store_timeout.py
"""

from __future__ import annotations

from kvdoctor.engine import compat
from kvdoctor.engine.p2p import P2PPair, P2PPlan

OFFSETS = (0, 5, 11, 20, 29, 31, 45, 61, 90)


def main() -> None:
    api = compat.load()
    pair = P2PPair(api, P2PPlan(delay_polls=3, abort_consumer_at=4))
    try:
        run = pair.run()
        print(f"vLLM {api.version_text}: {run.steps} steps, at rest {run.at_rest}; control messages "
              f"{[kind for _s, _r, kind in pair.fabric.sent]}")
        index = run.steps + 100
        for offset in OFFSETS:
            pair.harness.clock.offset = float(offset)
            for _ in range(3):
                index += 1
                pair.step(index)
            held = {side.name: side.p2p_jobs for side in pair.harness.sides_at_rest()}
            stores = [(job, ok) for job, ok, _e in pair.fabric.journals[pair.producer_id].results]
            print(f"  vLLM's P2P clock +{offset:>3} s: P2P jobs held {held}; producer's store results {stores}")
    finally:
        pair.shutdown()


if __name__ == "__main__":
    main()
