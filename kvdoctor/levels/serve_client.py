"""The HTTP client side of a served recipe: start and stop `vllm serve`, play the recipe's traffic, read
the stand-in executor's step log (standard library only).

The one definition used two ways: kvdoctor's serve level (`serve.run_serve`) imports it, and a script
exported with `--export-script FILE --engine serve` gets this module's code copied in on export (it
imports no kvdoctor). Hence no kvdoctor import, no vLLM import and no `from __future__` here.
"""

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

STEP_LOG_PREFIX = "kvdoctor-engine step"  # the stand-in executor's per-step log line (standin_executor.py)
STOP_LIMIT_S = 20.0
REQUEST_LIMIT_S = 120.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One `vllm serve` child in its own session; `stop()` ends its whole process group, bounded."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: str | os.PathLike[str]) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM to the group without waiting: several servers then shut down side by side (`stop` waits)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM to the group (API server and engine core), SIGKILL after STOP_LIMIT_S; the group is
        signalled even when the API server already exited (its engine core may linger)."""
        for sig, wait in ((signal.SIGTERM, STOP_LIMIT_S), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not _group_alive(self.pid):
                    return
                time.sleep(0.2)
        self.proc.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def http(port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
               timeout: float = 30.0) -> tuple[int, str]:
    """One HTTP/1.1 request on its own loopback connection, as (status, body); cancelling the task closes
    the socket (the client's disconnect)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        payload = json.dumps(body).encode() if body is not None else b""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n{extra}"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
        writer.write(head.encode() + payload)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
        status_line, _, rest = raw.decode(errors="replace").partition("\r\n")
        status = int(status_line.split()[1]) if status_line.startswith("HTTP/") else 0
        return status, rest.partition("\r\n\r\n")[2]
    finally:
        writer.close()


def request_tag(name: str) -> str:
    return f"kvdoctor-{name}-r"


async def wait_ready(port: int, server: Server, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and server.alive():
        try:
            status, _ = await http(port, "GET", "/health", timeout=5)
            if status == 200:
                return True
        except (TimeoutError, OSError):
            pass
        await asyncio.sleep(1.0)
    return False


@dataclass
class Played:
    notes: list[str] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)
    # request -> the token ids its client received (a stop token the server reports as the stop reason
    # included: the client knows it), for each request the server answered with a completion
    completions: dict[str, list[int]] = field(default_factory=dict)
    prompts: dict[str, list[int]] = field(default_factory=dict)  # request -> the prompt its client sent
    # request -> its prompt tokens the server found cached (usage.prompt_tokens_details.cached_tokens, where
    # the server runs with --enable-prompt-tokens-details): a client's view of its prefix hits
    cached_tokens: dict[str, int] = field(default_factory=dict)
    healthy: bool = False
    fresh_served: bool = False


def cached_tokens(body: str) -> int | None:
    """usage.prompt_tokens_details.cached_tokens of a /v1/completions answer (None where the body has none)."""
    try:
        details = json.loads(body)["usage"]["prompt_tokens_details"]
        return int(details["cached_tokens"])
    except (ValueError, KeyError, TypeError):
        return None


def completion_tokens(body: str) -> list[int] | None:
    """The token ids of a /v1/completions answer (sent with return_token_ids), a stop token the server
    names as the stop reason appended where the ids leave it out; None when the body holds none."""
    try:
        choice = json.loads(body)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    tokens = choice.get("token_ids")
    if not isinstance(tokens, list):
        return None
    tokens = [int(t) for t in tokens]
    stop = choice.get("stop_reason")
    if choice.get("finish_reason") == "stop" and isinstance(stop, int) and (not tokens or tokens[-1] != stop):
        tokens.append(stop)
    return tokens


async def play(port: int, model: str, events: Iterable[dict[str, Any]], step_seconds: float,
               echo: Callable[[str], None] | None = None, settle_steps: int = 4) -> Played:
    """The recipe's clients (events as dicts: kind add | step | abort | reset, request, prompt, max_tokens, an
    add's `extra` body fields (kv_transfer_params, priority, stop_token_ids, vllm_xargs) and `continues`:
    the request whose conversation it continues: its prompt and the completion its client received come
    first); then whether the server answers /health and a fresh request. `echo` sees each note as taken;
    requests still open at the recipe's end get `settle_steps` paced steps to finish."""
    played = Played()
    tasks: dict[str, asyncio.Task[tuple[int, str]]] = {}
    start = time.monotonic()
    events = list(events)
    # a request may stay open for the whole recipe (K11's A decodes through 150 engine steps): its client waits
    # that long, and twice as long again for an engine whose steps lag the pacing on a loaded machine
    request_limit = REQUEST_LIMIT_S + 2 * step_seconds * (sum(e["kind"] == "step" for e in events) + settle_steps)

    def note(text: str) -> None:
        played.notes.append(f"[{time.monotonic() - start:6.1f}s] {text}")
        if echo is not None:
            echo(played.notes[-1])

    def take(name: str, task: asyncio.Task[tuple[int, str]]) -> None:
        try:
            status, body = task.result()
        except (TimeoutError, OSError) as exc:
            played.answers[name] = type(exc).__name__
            note(f"{name} failed: {type(exc).__name__}")
            return
        played.answers[name] = f"HTTP {status}"
        tokens = completion_tokens(body) if status == 200 else None
        if tokens is not None:
            played.completions[name] = tokens
            cached = cached_tokens(body)
            if cached is not None:
                played.cached_tokens[name] = cached
        note(f"{name} answered HTTP {status}" + (f": tokens {tokens}" if tokens is not None else ""))

    pending_steps = 0
    for event in events:
        kind, name = event["kind"], event.get("request", "")
        if kind == "step":
            pending_steps += 1
            continue
        if pending_steps or kind == "abort":
            # the arrivals before it need at least two steps to reach the engine's queue
            await asyncio.sleep(max(pending_steps, 2) * step_seconds)
            pending_steps = 0
        if kind == "add":
            earlier: list[int] = []
            if event.get("continues"):
                before = event["continues"]
                if before in tasks:  # the next turn waits for the answer it continues
                    await asyncio.wait([tasks[before]], timeout=request_limit)
                    if tasks[before].done():
                        take(before, tasks.pop(before))
                if before not in played.completions:
                    note(f"{name} not sent: {before} gave no completion to continue")
                    continue
                earlier = played.prompts[before] + played.completions[before]
            prompt = earlier + list(event["prompt"])
            played.prompts[name] = prompt
            body = {"model": model, "prompt": prompt, "max_tokens": event["max_tokens"], "ignore_eos": True,
                    "temperature": 0.0, "return_token_ids": True, **event.get("extra", {})}
            tasks[name] = asyncio.create_task(http(port, "POST", "/v1/completions", body,
                                                   {"X-Request-Id": request_tag(name)}, request_limit))
            note(f"{name} sent: {len(prompt)} prompt tokens, max_tokens {event['max_tokens']}")
        elif kind == "reset":
            query = "&".join(f"{key}={'true' if value else 'false'}" for key, value in event.get("extra", {}).items())
            try:
                status, answer = await http(port, "POST", f"/reset_prefix_cache?{query}", timeout=30)
                note(f"POST /reset_prefix_cache?{query}: HTTP {status} {answer.strip()[:80]}")
            except (TimeoutError, OSError) as exc:
                note(f"POST /reset_prefix_cache failed: {type(exc).__name__}")
        elif kind == "abort":
            task = tasks.pop(name, None)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            note(f"{name} disconnected (the API server aborts it)")
    # The last arrivals reach the engine's queue (two paced steps); the recipe's trailing steps only let the engine
    # run (the executor paces no step past the client's last event, `paced_steps`): the requests still open get
    # them and `settle_steps` more to finish, ending as soon as they all have; then their clients disconnect (a
    # filler may never finish on a real server: the scheduler level stops driving it, the engine keeps it
    # preempted in a pool it cannot fit), and the server must then be healthy and serve a fresh request.
    await asyncio.sleep(2 * step_seconds)
    if tasks:
        await asyncio.wait(list(tasks.values()), timeout=(max(pending_steps - 2, 0) + settle_steps) * step_seconds)
    for name, task in tasks.items():
        if task.done():
            take(name, task)
            continue
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        played.answers[name] = "disconnected at the recipe's end"
        note(f"{name} still open at the recipe's end: disconnected")
    await asyncio.sleep(2 * step_seconds)
    try:
        status, _ = await http(port, "GET", "/health", timeout=10)
        played.healthy = status == 200
        note(f"/health: HTTP {status}")
    except (TimeoutError, OSError) as exc:
        note(f"/health failed: {type(exc).__name__}")
    if played.healthy:
        try:
            status, _ = await http(port, "POST", "/v1/completions",
                                   {"model": model, "prompt": [11, 12, 13, 14], "max_tokens": 2, "ignore_eos": True},
                                   {"X-Request-Id": request_tag("fresh")}, 60)
            played.fresh_served = status == 200
            note(f"a fresh request answered HTTP {status}")
        except (TimeoutError, OSError) as exc:
            note(f"a fresh request failed: {type(exc).__name__}")
    return played


def step_log(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The stand-in executor's step records (what each engine step scheduled and finished), in order."""
    steps = []
    for line in lines:
        index = line.find(STEP_LOG_PREFIX)
        if index < 0:
            continue
        _, _, payload = line[index:].partition(": ")
        try:
            steps.append(json.loads(payload))
        except json.JSONDecodeError:
            continue
    return steps


def aborted_while_queued(lines: Iterable[str], name: str) -> bool | None:
    """From the executor's step log: True when the request finished without ever being scheduled;
    False when it was scheduled first; None when the log never names it."""
    tag = request_tag(name)
    scheduled = finished = False
    for step in step_log(lines):
        if any(tag in rid for rid in step.get("scheduled", {})):
            scheduled = True
        if any(tag in rid for rid in step.get("finished", [])):
            finished = True
            break
    if not finished:
        return None
    return not scheduled


def ever_scheduled(lines: Iterable[str], name: str) -> bool:
    tag = request_tag(name)
    return any(tag in rid for step in step_log(lines) for rid in step.get("scheduled", {}))
