"""The scripted tier's script and backpressure pattern (`Setup.tier_script`, `Setup.backpressure_pattern`),
parsed without importing vLLM: a setup is validated at the CLI, before any vLLM import."""

from __future__ import annotations

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
    """`"1,1,0"`: store decisions (1 store, 0 drop the cascade), cycled over the tier's cascades."""
    bits = tuple(t.strip() for t in pattern.split(",") if t.strip())
    if not bits or any(b not in ("0", "1") for b in bits):
        raise ValueError(f"backpressure pattern must be 0s and 1s separated by commas, got {pattern!r}")
    return tuple(b == "1" for b in bits)


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
        parse_pattern(pattern)
    except ValueError as error:
        return str(error)
    return None
