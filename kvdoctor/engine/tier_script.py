"""The scripted tier's script and backpressure pattern (`Setup.tier_script`, `Setup.backpressure_pattern`),
parsed without importing vLLM: a setup is validated at the CLI, before any vLLM import."""

from __future__ import annotations

from dataclasses import dataclass

STORE_OUTCOMES = ("ok", "late", "fail")
LOAD_OUTCOMES = ("ok", "late", "fail", "partial", "defer")


def parse_script(script: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`"ok,late/defer,ok"`: store (cascade) outcomes before the slash, load (promotion) outcomes after it,
    each cycled over that kind's jobs; a side left out is all "ok". Raises ValueError on an unknown outcome."""
    stores, _, loads = (script or "").partition("/")
    parsed = []
    for text, allowed in ((stores, STORE_OUTCOMES), (loads, LOAD_OUTCOMES)):
        outcomes = tuple(t.strip() for t in text.split(",") if t.strip()) or ("ok",)
        unknown = [o for o in outcomes if o not in allowed]
        if unknown:
            raise ValueError(f"unknown outcome {unknown[0]!r} (expected one of {'|'.join(allowed)})")
        parsed.append(outcomes)
    return parsed[0], parsed[1]


def parse_pattern(pattern: str) -> tuple[bool, ...]:
    """`"1,1,0"`: store decisions (1 store, 0 drop the cascade), cycled over the tier's cascades (`"vllm[:...]"`
    names vLLM's own detector instead: `parse_vllm_backpressure`)."""
    bits = tuple(t.strip() for t in pattern.split(",") if t.strip())
    if not bits or any(b not in ("0", "1") for b in bits):
        raise ValueError(f"backpressure pattern must be 0s and 1s separated by commas, or \"vllm[:...]\" (vLLM's "
                         f"own detector), got {pattern!r}")
    return tuple(b == "1" for b in bits)


VLLM_DETECTOR = "vllm"  # a backpressure pattern naming vLLM's own detector (compat/vllm_backpressure.py)
POLICIES = {"throttle": "RecordedThrottledPolicy", "drop": "RecordedDropPolicy"}  # vLLM's Throttled/DropStore


@dataclass(frozen=True)
class VllmBackpressure:
    """`"vllm"` or `"vllm:policy=drop,step_s=1,high=64,low=16,warmup=2,half_life=2,cooldown=2,failures=2"`:
    vLLM's EMABackpressureDetector and its policy, on kvdoctor's step clock (compat/step_clock.py), which moves
    `step_s` seconds per scheduler step. `high`/`low` are vLLM's water marks (seconds per MiB stored), `warmup` its
    warm-up completions, `half_life`/`cooldown` its idle decay and cooldown (step-clock seconds), `failures` its
    failure threshold (None: failed stores are not pressure)."""

    policy: str = "throttle"
    step_s: float = 1.0
    high: float = 64.0
    low: float = 16.0
    warmup: int = 2
    half_life: float = 2.0
    cooldown: float = 2.0
    failures: int | None = None

    def detector_kwargs(self) -> dict[str, float | int]:
        """The EMABackpressureDetector's keyword arguments (what vLLM's factory passes it from the dict)."""
        kwargs: dict[str, float | int] = {"high_water_s": self.high, "low_water_s": self.low,
                                          "warmup_completions": self.warmup, "decay_half_life_s": self.half_life,
                                          "cooldown_s": self.cooldown}
        if self.failures is not None:
            kwargs["failure_threshold"] = self.failures
        return kwargs


_FIELDS = {"step_s": float, "high": float, "low": float, "warmup": int, "half_life": float, "cooldown": float,
           "failures": int}


def parse_vllm_backpressure(pattern: str) -> VllmBackpressure | None:
    """The vLLM detector a backpressure pattern names, None for a 0/1 pattern. Raises ValueError on a bad one."""
    head, _, tail = pattern.strip().partition(":")
    if head.strip() != VLLM_DETECTOR:
        return None
    values: dict[str, object] = {}
    for item in (t.strip() for t in tail.split(",") if t.strip()):
        name, _, text = (part.strip() for part in item.partition("="))
        if name == "policy":
            if text not in POLICIES:
                raise ValueError(f"backpressure policy must be one of {'|'.join(POLICIES)}, got {text!r}")
            values[name] = text
            continue
        if name not in _FIELDS:
            raise ValueError(f"unknown vLLM backpressure parameter {name!r} (expected policy|{'|'.join(_FIELDS)})")
        try:
            values[name] = _FIELDS[name](text)
        except ValueError:
            raise ValueError(f"vLLM backpressure parameter {name}: not a number: {text!r}") from None
    spec = VllmBackpressure(**values)  # type: ignore[arg-type]
    if not (spec.step_s > 0 and 0 <= spec.low <= spec.high and spec.warmup >= 0 and spec.half_life >= 0
            and spec.cooldown >= 0 and (spec.failures is None or spec.failures >= 1)):
        raise ValueError(f"vLLM backpressure parameters out of range in {pattern!r} (step_s > 0, 0 <= low <= high, "
                         f"failures >= 1)")
    return spec


def check_script(script: str) -> str | None:
    """Why `script` is not a tier script, or None."""
    try:
        parse_script(script)
    except ValueError as error:
        return str(error)
    return None


def check_pattern(pattern: str) -> str | None:
    """Why `pattern` is not a backpressure pattern, or None."""
    try:
        if parse_vllm_backpressure(pattern) is None:
            parse_pattern(pattern)
    except ValueError as error:
        return str(error)
    return None
