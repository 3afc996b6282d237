"""Did the run execute the recipe's crash site? Counted by the interpreter, for that one code object.

A `not_reproduced` is evidence of a fix only when the run reached the code the
bug lives in. A recipe's signature names that code (`Signature.site()`: a vLLM
function and one of its statements); this module finds the function among the
classes the run's engine really uses, reads the statement from the installed
source, and counts the statement's executions while the scenario runs. For an
assert (or a guarded `if`) whose test is one comparison, the values compared
are recorded where the margin was closest, so a report can say how near the
buggy side the run came.

Tracing is scoped to the site's code object (`LineTracer`): `sys.monitoring`
local events on 3.12+; before that a `sys.settrace` whose global function
returns a local tracer for that code object only. Either is removed on exit,
even when the scenario raises, and a trace function already installed (a
debugger, coverage) is chained, then restored: it keeps seeing every frame.
"""

from __future__ import annotations

import ast
import builtins
import linecache
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import CodeType, FrameType, FunctionType
from typing import Any

from kvdoctor.engine.compat.names import function_spellings

# Where in vLLM a site's function is looked for when the engine's own objects do not hold it.
_MODULE_HINTS = ("offload", "kv_connector", "vllm.v1.core")
_SAFE_CALLS = {"len", "min", "max", "abs"}
_OPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}


@dataclass
class Site:
    """A crash site as found in the installed vLLM (or why it was not)."""

    function: str
    statement: str                        # the recipe's text for the statement
    codes: tuple[CodeType, ...] = ()      # the function's code objects that hold the statement
    hooks: tuple[type, ...] = ()          # classes whose plain function `function` holds it (3.11: traced per call)
    lines: dict[CodeType, frozenset[int]] = field(default_factory=dict)  # each code's statement lines
    starts: dict[CodeType, dict[int, int]] = field(default_factory=dict)  # line -> its statement's first
    compares: dict[tuple[CodeType, int], Any] = field(default_factory=dict)  # statement start -> Compare
    when: Any = None                      # compiled `site_when`: a hit counts only where it is true
    when_text: str = ""
    source: str = ""                      # the matched statement, as installed (first match)
    where: str = ""                       # Class.function (file:line)
    gone: str | None = None               # why the site is not in the installed vLLM


@dataclass
class Coverage:
    """What the run did at its crash site: `hits` executions, and the closest comparison seen."""

    function: str
    statement: str
    source: str = ""
    where: str = ""
    gone: str | None = None
    when: str = ""                 # the signature's `site_when`: the bug's case at the site
    executed: int = 0              # times the statement ran (whatever `when` said)
    hits: int = 0                  # times it ran in the bug's case (`when` true; every run without one)
    closest: str | None = None     # e.g. "64 <= 64": the compared values where the margin was smallest
    margin: float | None = None    # how far that comparison was from failing (0: on the edge)
    fired: bool = False            # the run's failure is this site's (set by the verdict)
    measured: bool = True          # False: no way to trace here (every sys.monitoring tool id taken)

    @property
    def reached(self) -> bool:
        return self.hits > 0

    def line(self) -> str:
        """One line for a report: 'reached 3x: held (closest: 64 <= 64)'."""
        if self.gone:
            return f"site gone: {self.gone}"
        if not self.measured:
            return "coverage not measured (no free sys.monitoring tool id)"
        if not self.hits:
            if self.when and self.executed:
                return (f"not reached: the run executed {self.describe_site()} {self.executed}x, never with "
                        f"`{self.when}`")
            return f"not reached: the recipe's path does not reach {self.describe_site()}"
        text = f"reached {self.hits}x: " + ("fired" if self.fired else "held")
        if self.closest and not self.fired:
            text += f" (closest: {self.closest})"
        return text

    def describe_site(self) -> str:
        text = f"{self.function}'s `{self.source or self.statement}`"
        return text + (f" with `{self.when}`" if self.when and not self.executed else "")

    def as_dict(self) -> dict[str, Any]:
        return {"function": self.function, "statement": self.source or self.statement, "where": self.where,
                "gone": self.gone, "when": self.when or None, "reached": self.reached, "hits": self.hits,
                "executed": self.executed, "fired": self.fired,
                "closest": self.closest, "margin": self.margin, "summary": self.line()}


# -- finding the site ---------------------------------------------------------------------------

def _normalize(text: str) -> str:
    """One spelling for statement text: whitespace collapsed, none inside brackets' edges (as
    `failure.statement_source` joins a multi-line statement)."""
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(r"\s+([)\]])", r"\1", re.sub(r"([(\[])\s+", r"\1", text))


def _engine_classes(roots: Iterable[Any], depth: int = 3) -> list[type]:
    """vLLM classes of the engine's objects and of what they hold, a few levels down (the connector
    scheduler's manager, a tiering manager's tiers), in the order found."""
    seen_ids: set[int] = set()
    classes: list[type] = []
    frontier = list(roots)
    for _ in range(depth):
        following: list[Any] = []
        for obj in frontier:
            if obj is None or id(obj) in seen_ids:
                continue
            seen_ids.add(id(obj))
            if isinstance(obj, (list, tuple)):
                following.extend(obj[:8])
                continue
            if isinstance(obj, dict):
                following.extend(list(obj.values())[:8])
                continue
            cls = type(obj)
            if not cls.__module__.startswith("vllm."):
                continue
            for klass in cls.__mro__:
                if klass not in classes and klass.__module__.startswith("vllm."):
                    classes.append(klass)
            following.extend(getattr(obj, "__dict__", {}).values())
        frontier = following
    return classes


def _module_classes() -> list[type]:
    classes = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm.") or not any(h in name for h in _MODULE_HINTS) or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                classes.append(value)
    return classes


def _functions(classes: Iterable[type], name: str) -> list[tuple[str, CodeType]]:
    return [(klass.__qualname__, code) for klass, code in _owners(classes, name)]


def _owners(classes: Iterable[type], name: str) -> list[tuple[type, CodeType]]:
    """(class, code) of each class that defines `name` itself, one per distinct code object."""
    found: list[tuple[type, CodeType]] = []
    for klass in classes:
        raw = klass.__dict__.get(name)
        raw = getattr(raw, "__func__", raw)
        raw = getattr(raw, "__wrapped__", raw)
        code = getattr(raw, "__code__", None)
        if isinstance(code, CodeType) and all(code is not c for _, c in found):
            found.append((klass, code))
    return found


def _statements(code: CodeType) -> list[tuple[int, int, str, ast.stmt]]:
    """(first line, last line, normalized text, node) of each statement in the function's own body;
    a compound statement contributes its header."""
    lines = linecache.getlines(code.co_filename)
    if not lines:
        return []
    code_lines = [line for _, _, line in code.co_lines() if line is not None and line != code.co_firstlineno]
    first, last = min(code_lines, default=code.co_firstlineno), max(code_lines, default=code.co_firstlineno)
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return []
    # The def whose body holds the code's lines (co_firstlineno is a decorator's line when decorated).
    enclosing = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == code.co_name and n.lineno <= first and last <= (n.end_lineno or 0)]
    func = min(enclosing, key=lambda n: (n.end_lineno or 0) - n.lineno, default=None)
    if func is None:
        return []
    out = []
    stack: list[ast.AST] = list(func.body)
    while stack:
        node = stack.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue  # nested code objects are not the site's code object
        if not isinstance(node, ast.stmt):
            continue
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):  # a compound statement: its header
            end = max(node.lineno, body[0].lineno - 1)
        else:
            end = node.end_lineno or node.lineno
        text = _normalize(" ".join(lines[n - 1].strip() for n in range(node.lineno, end + 1)))
        out.append((node.lineno, end, text, node))
        for attr in ("body", "orelse", "finalbody", "handlers"):
            stack.extend(getattr(node, attr, None) or [])
        for case in getattr(node, "cases", None) or []:
            stack.extend(case.body)
    return out


def _safe(node: ast.AST) -> bool:
    """An operand kvdoctor may evaluate in vLLM's frame: names, attributes, arithmetic, len()..."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            if not (isinstance(sub.func, ast.Name) and sub.func.id in _SAFE_CALLS) or sub.keywords:
                return False
        elif not isinstance(sub, (ast.Name, ast.Attribute, ast.Constant, ast.BinOp, ast.UnaryOp, ast.Load,
                                  ast.operator, ast.unaryop, ast.Subscript, ast.Slice, ast.Tuple)):
            return False
    return True


_WHEN_NODES = (ast.Compare, ast.BoolOp, ast.And, ast.Or, ast.cmpop, ast.Not)


def parse_when(text: str) -> ast.Expression:
    """A `site_when` condition, parsed and checked: one expression over the site frame's names,
    attributes, constants, arithmetic, comparisons, and/or/not, len/min/max/abs. Nothing else is
    accepted, so a recipe stays data. Raises ValueError saying why."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression ({exc.msg})") from None
    for node in ast.walk(tree.body):
        if isinstance(node, _WHEN_NODES):
            continue
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in _SAFE_CALLS) or node.keywords:
                raise ValueError("only len, min, max and abs may be called")
        elif not isinstance(node, (ast.Name, ast.Attribute, ast.Constant, ast.BinOp, ast.UnaryOp, ast.Load,
                                   ast.operator, ast.unaryop, ast.Subscript, ast.Slice, ast.Tuple)):
            raise ValueError(f"{type(node).__name__} is not allowed (names, attributes, arithmetic, "
                             f"comparisons, and/or/not)")
    return tree


_WHEN_BUILTINS = {"__builtins__": {name: getattr(builtins, name) for name in _SAFE_CALLS}}


def _compare_of(node: ast.stmt, filename: str) -> Any:
    """(op, left code, right code) when the statement's test is one comparison of safe operands."""
    test = node.test if isinstance(node, (ast.Assert, ast.If, ast.While)) else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _OPS):
        return None
    left, right = test.left, test.comparators[0]
    if not (_safe(left) and _safe(right)):
        return None
    def compile_(expr: ast.expr) -> CodeType:
        return compile(ast.Expression(expr), filename, "eval")

    return _OPS[type(test.ops[0])], compile_(left), compile_(right)


def _whole_statement(text: str) -> ast.stmt | None:
    """`text` as one whole assert or raise statement (a recipe written from a log quotes one), else None (a
    fragment: `len(a) == len(b)`, `not found`)."""
    try:
        body = ast.parse(text.strip()).body
    except (SyntaxError, ValueError):
        return None
    return body[0] if len(body) == 1 and isinstance(body[0], (ast.Assert, ast.Raise)) else None


def _is_the_statement(found: tuple[int, int, str, ast.stmt], wanted: str, whole: ast.stmt | None,
                      asserts_only: bool) -> bool:
    """A whole statement is that statement (its test compared as a tree, its message aside); a fragment is any
    statement holding it, only an assert where the crash is an AssertionError."""
    node = found[3]
    if asserts_only and not isinstance(node, ast.Assert):
        return False
    if whole is not None:
        def key(n: ast.stmt) -> str:
            return ast.dump(n.test) if isinstance(n, ast.Assert) else ast.dump(n)

        return type(node) is type(whole) and key(node) == key(whole)
    return _holds(found, wanted)


def _holds(found: tuple[int, int, str, ast.stmt], wanted: str) -> bool:
    """The statement's text holds the fragment, or one of its string constants does: a message written as
    adjacent literals (`"... requests are " "preempted ..."`, one constant to Python) is matched by its value,
    as the exception printed it (0.34's reset_prefix_cache RuntimeError was called absent otherwise)."""
    return wanted in found[2] or any(isinstance(n, ast.Constant) and isinstance(n.value, str)
                                     and wanted in _normalize(n.value) for n in _own_nodes(found[3]))


def _own_nodes(node: ast.stmt) -> list[ast.AST]:
    """A statement's own expressions: a compound statement's header, not the statements in its blocks; an `if`
    also owns the `raise` statements directly in its body, its guard (`if not reset(): raise RuntimeError(...)`:
    the `if` reached without raising is the site held, as an assert's test is)."""
    nested = ("body", "orelse", "finalbody", "handlers", "cases")
    own: list[ast.AST] = []
    if isinstance(node, ast.If):
        for raised in (child for child in node.body if isinstance(child, ast.Raise)):
            own.extend(ast.walk(raised))
    for name, value in ast.iter_fields(node):
        if name in nested:
            continue
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, ast.AST):
                own.extend(ast.walk(child))
    return own


def _like(found: tuple[int, int, str, ast.stmt], wanted: str, whole: ast.stmt | None) -> bool:
    """Another statement a reader could take for the crash statement: it holds the fragment, or is of the
    whole statement's kind and names one of its names."""
    if whole is None:
        return _holds(found, wanted)
    names = {n.id for n in ast.walk(whole) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(whole) if isinstance(n, ast.Attribute)}
    return isinstance(found[3], type(whole)) and any(re.search(rf"\b{re.escape(n)}\b", found[2]) for n in names)


def find_site(function: str, statement: str, roots: Iterable[Any], when: str | None = None,
              asserts_only: bool = False) -> Site:
    """The site in the installed vLLM: `function` on the engine's classes (else in vLLM's connector
    and core modules), and its statements whose text contains `statement` (or are it, when `statement` is
    a whole statement; asserts only when `asserts_only`: the crash is an AssertionError). Where only other
    statements hold that text, the crash statement is absent in this release (`gone` says so)."""
    site = Site(function, statement)
    if when:
        site.when_text = when.strip()
        site.when = compile(parse_when(when), "<site_when>", "eval")
    owners = _owners(_engine_classes(roots), function) or _owners(_module_classes(), function)
    functions = [(klass.__qualname__, code) for klass, code in owners]
    if not functions:
        site.gone = f"no function {function} in the installed vLLM's connector or scheduler classes"
        return site
    wanted = _normalize(statement)
    whole = _whole_statement(statement)
    others: list[str] = []
    for owner, code in functions:
        statements = _statements(code)
        matched = [s for s in statements if _is_the_statement(s, wanted, whole, asserts_only)]
        others += [s[2] for s in statements if s not in matched and _like(s, wanted, whole)]
        if not matched:
            continue
        site.codes += (code,)
        site.hooks += tuple(klass for klass, c in owners if c is code and type(klass.__dict__[function])
                            is FunctionType)
        site.lines[code] = frozenset(n for first, end, _, _ in matched for n in range(first, end + 1))
        site.starts[code] = {n: first for first, end, _, _ in matched for n in range(first, end + 1)}
        for first, _, _, node in matched:
            site.compares[(code, first)] = _compare_of(node, code.co_filename)
        if not site.source:
            first, _, text, _ = matched[0]
            site.source = text
            site.where = f"{owner}.{function} ({_short(code.co_filename)}:{first})"
    if not site.codes:
        owner = functions[0][0]
        site.gone = (f"{owner}.{function} has no statement containing `{wanted}` in the installed vLLM "
                     f"(the code changed)")
        if others:  # what is there instead is another statement: never "reached: held" on it
            what = f"`{wanted}`" if whole is not None else f"(an assert holding `{wanted}`)"
            site.gone = (f"the crash statement {what} is absent in this release: {owner}.{function} has "
                         f"{len(others)} other statement{'s' if len(others) > 1 else ''} like it "
                         f"(`{others[0][:120]}`)")
    return site


def _short(path: str) -> str:
    index = path.replace("\\", "/").rfind("/vllm/")
    return path[index + 1:] if index >= 0 else path


# -- counting -----------------------------------------------------------------------------------

class LineTracer:
    """Statement events of a few code objects inside `start()` .. `stop()`, at the least cost to the rest of
    the run: `on_statement(frame, code, start)` each time one of their statements begins to execute
    (`starts`: code -> line -> the first line of its statement), `on_call(code)` at each call of one.

    3.12+: `sys.monitoring` local events on those code objects only. 3.11: a trace function is the only way
    to see line events, and while one is set every call in the thread pays for it (3x a run, measured). So
    where each class of `hooks` defines `function` as a plain function whose code objects are exactly the
    traced ones, each gets, for the scope, a pass-through that turns tracing on around the call only; else
    a global trace function traces those code objects for the whole scope. A trace function already
    installed (a debugger, coverage) is chained: it keeps seeing every frame, the traced ones' lines too.
    One implementation for the crash site (`SiteTracer`) and a hunt's whole function
    (`observe.function_lines`)."""

    def __init__(self, function: str, starts: dict[CodeType, dict[int, int]], hooks: tuple[type, ...],
                 on_statement: Callable[[FrameType, CodeType, int], None],
                 on_call: Callable[[CodeType], None] | None = None) -> None:
        self.function = function
        self._starts = starts
        self._codes = frozenset(starts)
        self._hooks = hooks
        self._on_statement = on_statement
        self._on_call = on_call
        self._last: dict[int, int] = {}  # id(frame) -> the statement start its last line event was in
        self._previous: Any = None
        self._tool: int | None = None
        self._hooked: list[tuple[type, Any]] = []
        self._global = False

    def start(self) -> bool:
        """Start tracing; False when nothing can be traced here (every sys.monitoring tool id taken)."""
        if not self._codes:
            return True
        if sys.version_info >= (3, 12):
            return self._start_monitoring()
        if self._hooks_cover_codes():
            self._start_per_call()
        else:
            self._previous = sys.gettrace()
            sys.settrace(self._global_trace_function(self._previous))
            self._global = True
        return True

    def stop(self) -> None:
        """Remove what `start` installed (the previous trace function back in place)."""
        if self._tool is not None:
            self._stop_monitoring()
        for klass, original in self._hooked:
            setattr(klass, self.function, original)
        self._hooked = []
        if self._global:
            sys.settrace(self._previous)
            self._global = False
        self._last.clear()

    # one line event in a traced code object (3.12+: sys.monitoring gives no per-frame state to keep it in)
    def _line(self, frame: FrameType, code: CodeType, lineno: int) -> None:
        start = self._starts[code].get(lineno)
        key = id(frame)
        if start is None:
            self._last.pop(key, None)
            return
        if self._last.get(key) == start:
            return  # another line of the statement being executed
        self._last[key] = start
        self._on_statement(frame, code, start)

    def _hooks_cover_codes(self) -> bool:
        name = self.function
        return bool(self._hooks) and {klass.__dict__[name].__code__ for klass in self._hooks} == set(self._codes)

    def _start_per_call(self) -> None:
        import functools

        global_trace = self._global_trace_function(None)
        for klass in self._hooks:
            original = klass.__dict__[self.function]

            def traced(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
                previous = sys.gettrace()
                sys.settrace(global_trace if previous is None else self._global_trace_function(previous))
                try:
                    return __original(*args, **kwargs)
                finally:
                    sys.settrace(previous)

            self._hooked.append((klass, original))
            setattr(klass, self.function, functools.wraps(original)(traced))

    def _global_trace_function(self, previous: Any) -> Any:
        """A global trace function that gives each frame of a traced code object its own line tracer: one
        closure per call, holding the statement it is in, so a line event outside the traced statements
        costs one dict lookup (the tracer runs on every line of the traced function). `previous` (a trace
        function installed before) gets every other frame, and its own tracer of the traced frames is
        called beside ours."""
        # keyed by id: a code object's own hash walks its constants, and this runs on every call
        starts = {id(code): lines for code, lines in self._starts.items()}
        hit, called = self._on_statement, self._on_call

        def global_trace(frame: FrameType, event: str, arg: Any) -> Any:
            code = frame.f_code
            lines = starts.get(id(code))
            if lines is None:
                return previous(frame, event, arg) if previous is not None else None
            if called is not None:
                called(code)
            theirs = previous(frame, event, arg) if previous is not None else None
            current: int | None = None  # first line of the traced statement this frame is in

            def local(frame: FrameType, event: str, arg: Any) -> Any:
                nonlocal current, theirs
                if event == "line":
                    start = lines.get(frame.f_lineno)
                    if start is not None and start != current:
                        hit(frame, code, start)
                    current = start
                if theirs is not None:  # a local tracer may replace itself, or stop (None), as it would alone
                    theirs = theirs(frame, event, arg)
                return local

            return local

        return global_trace

    # 3.12+: LINE events on the traced code objects only
    def _start_monitoring(self) -> bool:
        monitoring = sys.monitoring  # type: ignore[attr-defined]  # 3.12+ only; mypy checks as 3.11
        tool = next((t for t in range(5, -1, -1) if monitoring.get_tool(t) is None), None)
        if tool is None:  # every tool id taken: count nothing rather than disturb another tool
            return False
        monitoring.use_tool_id(tool, "kvdoctor-coverage")
        self._tool = tool
        on_line, called, last = self._line, self._on_call, self._last

        def line_event(code: CodeType, lineno: int) -> Any:
            on_line(sys._getframe(1), code, lineno)

        def start_event(code: CodeType, offset: int) -> Any:
            last.pop(id(sys._getframe(1)), None)  # a new call: a frame id may be reused
            if called is not None:
                called(code)

        events = monitoring.events
        monitoring.register_callback(tool, events.LINE, line_event)
        monitoring.register_callback(tool, events.PY_START, start_event)
        for code in self._codes:
            monitoring.set_local_events(tool, code, events.LINE | events.PY_START)
        return True

    def _stop_monitoring(self) -> None:
        monitoring = sys.monitoring  # type: ignore[attr-defined]  # 3.12+ only; mypy checks as 3.11
        for code in self._codes:
            monitoring.set_local_events(self._tool, code, 0)
        monitoring.register_callback(self._tool, monitoring.events.LINE, None)
        monitoring.register_callback(self._tool, monitoring.events.PY_START, None)
        monitoring.free_tool_id(self._tool)
        self._tool = None


class SiteTracer:
    """Counts the site's executions inside a `with` block (traced by `LineTracer`, its statements only)."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self.coverage = Coverage(site.function, site.statement, site.source, site.where, site.gone,
                                 site.when_text)
        self._lines = LineTracer(site.function, site.starts, site.hooks, self._hit)

    # the site statement starting at `start` begins to execute in `frame`
    def _hit(self, frame: FrameType, code: CodeType, start: int) -> None:
        self.coverage.executed += 1
        if self.site.when is not None:
            try:
                # a condition parse_when checked (names, literals, compares only)
                if not eval(self.site.when, _WHEN_BUILTINS, frame.f_locals):
                    return
            except Exception:  # a name not bound here: not the bug's case
                return
        self.coverage.hits += 1
        compare = self.site.compares.get((code, start))
        if compare is not None:
            self._measure(compare, frame)

    def _measure(self, compare: Any, frame: FrameType) -> None:
        op, left_code, right_code = compare
        try:
            left = eval(left_code, frame.f_globals, frame.f_locals)  # checked by _safe
            right = eval(right_code, frame.f_globals, frame.f_locals)
        except Exception:  # a value not yet bound: no measurement, never a failure
            return
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right)):
            return
        if op not in ("<", "<=", ">", ">="):
            return  # an equality has no side to come near: held or not is all there is
        margin = {"<": right - left - 1, "<=": right - left, ">": left - right - 1, ">=": left - right}[op]
        if self.coverage.margin is None or margin < self.coverage.margin:
            self.coverage.margin = margin
            self.coverage.closest = f"{left} {op} {right}"

    def __enter__(self) -> Coverage:
        if not self._lines.start():
            self.coverage.measured = False
        return self.coverage

    def __exit__(self, *exc: Any) -> None:
        self._lines.stop()


_SITES: dict[tuple[Any, ...], Site] = {}


def site_tracer(signature: Any, harness: Any) -> Any:
    """The tracing scope for one run: counts the signature's crash site on the harness's engine (a
    no-op scope yielding None when the signature names no site). Sites are found once per process
    and set of engine classes (explore runs thousands of scenarios)."""
    import contextlib

    crash_site = signature.crash_site()
    if crash_site is None:
        return contextlib.nullcontext(None)
    roots = (harness.scheduler, harness.connector_scheduler)
    when = getattr(signature, "site_when", None)
    # The statement under the site's function, else under its first other spelling that holds it (vLLM moved
    # it): the adapter's names table for any site function, and the recipe's own `function_aliases` where the
    # site is its `function`.
    recipe_aliases = () if getattr(signature, "site_function", None) else getattr(signature, "function_aliases", ())
    spellings = tuple(dict.fromkeys((*function_spellings(crash_site[0]), *recipe_aliases)))
    aliases = spellings[1:]
    asserts_only = getattr(signature, "exception", None) == "AssertionError"  # the crash statement is an assert
    key = (*crash_site, *aliases, when or "", tuple(type(r) for r in roots), asserts_only)
    site = _SITES.get(key)
    if site is None:
        sites = [find_site(name, crash_site[1], roots, when, asserts_only) for name in spellings]
        site = _SITES[key] = next((found for found in sites if not found.gone), sites[0])
        if site.gone and aliases:
            site.gone = "; ".join(found.gone or "" for found in sites)
    return SiteTracer(site)
