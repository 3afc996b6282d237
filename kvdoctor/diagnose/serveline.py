"""What a log says about the server: the vLLM version and the serve arguments that matter.

Sources, first found wins: the start-up banner (`vLLM API server version X`,
`Initializing a V1 LLM engine (vX)`, the ASCII-art logo's `version X`; the
crash dump's `Dumping input data for V1 LLM engine (vX)`), else a
container image tag `vllm/vllm-openai:vX`; the `non-default args: {...}` line,
else a `vllm serve ...` command line. Only the arguments of
the serve-flag table's `serve_args.SERVE_ARGS_OF_INTEREST` are kept, so nothing else from the args
line (API keys, hosts, paths) is ever held.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from kvdoctor.diagnose.pyrepr import parse_repr
from kvdoctor.engine.serve_args import SERVE_ARGS_OF_INTEREST, SWITCH_ARGS, normalise_arg_name

_VERSION = r"(\d+\.\d+\.\d+(?:[.+\-][\w.+\-]*)?|\d+\.\d+\.\d+)"
_BANNER_VERSIONS = (
    re.compile(r"vLLM API server version " + _VERSION),
    re.compile(r"V1 LLM engine \(v" + _VERSION + r"\)"),  # "Initializing a ..." and "Dumping input data for ..."
    re.compile(r"vLLM version " + _VERSION),
)
_LOGO_VERSION = re.compile(r"[\u2580-\u259f].*\bversion " + _VERSION)
_IMAGE_VERSION = re.compile(r"vllm/vllm-openai:v" + _VERSION)
_ARGS = re.compile(r"non-default args:\s*(\{.*)")
_SERVE = re.compile(r"(?:^|[\s/])vllm\s+serve\s+(.*)|vllm\.entrypoints\.openai\.api_server\s+(.*)")


def banner_version(body: str) -> str | None:
    for pattern in _BANNER_VERSIONS:
        match = pattern.search(body)
        if match:
            return match.group(1).rstrip(".")
    match = _LOGO_VERSION.search(body)
    return match.group(1).rstrip(".") if match else None


def image_version(body: str) -> str | None:
    match = _IMAGE_VERSION.search(body)
    return match.group(1).rstrip(".") if match else None


def _keep(args: dict[Any, Any]) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    for key, value in args.items():
        if not isinstance(key, str):
            continue
        name = normalise_arg_name(key)
        if name in SERVE_ARGS_OF_INTEREST:
            kept[name] = value
    return kept


def non_default_args(body: str) -> dict[str, Any] | None:
    match = _ARGS.search(body)
    if not match:
        return None
    value = parse_repr(match.group(1))
    return _keep(value) if isinstance(value, dict) else None


def command_line_args(body: str) -> dict[str, Any] | None:
    """The arguments of a `vllm serve MODEL --flag value ...` line (tolerant of bad quoting)."""
    match = _SERVE.search(body)
    if not match:
        return None
    rest = (match.group(1) if match.group(1) is not None else match.group(2)) or ""
    try:
        words = shlex.split(rest[:100_000], posix=True)
    except ValueError:
        words = rest[:100_000].split()
    return _keep(argv_args(words, first_is_model=match.group(1) is not None))


def argv_args(words: list[str], first_is_model: bool = False) -> dict[str, Any]:
    """`--flag value`, `--flag=value`, `--switch` and `--no-switch` words as serve arguments (underscore
    names, values as written; `first_is_model`: `vllm serve MODEL ...`'s positional model), every flag kept."""
    args: dict[str, Any] = {}
    words = list(words)
    if first_is_model and words and not words[0].startswith("-"):
        args["model"] = words.pop(0)
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue
        if "=" in word:
            name, value = word.split("=", 1)
            args[normalise_arg_name(name)] = value
            continue
        name = normalise_arg_name(word)
        if name.startswith("no_") and name[3:] in SWITCH_ARGS:
            args[name[3:]] = False
            continue
        if i < len(words) and not words[i].startswith("--"):
            args[name] = words[i]
            i += 1
        else:
            args[name] = True
    return args
