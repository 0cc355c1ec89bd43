"""The Jinja environment chat templates are rendered in, built as transformers builds
it (``utils/chat_template_utils._compile_jinja_template``), plus the two questions
vLLM asks of a template's syntax tree: which variables it reads, and whether it loops
over a message's content (the "openai" content format) or not ("string").

Templates come from model repositories or requests, so they are untrusted code: the
immutable sandbox, the restricted ``dict``/``namespace`` globals and jinja2>=3.1.6 are
transformers' defences and are kept here for the same reason.  The sandbox stops
escapes but not denial of service (nested ``range`` loops run 10^10 iterations,
``'a' * 10**9`` allocates a gigabyte), so every render also runs under ``RenderLimits``:
a step budget (loop iterations and calls), a wall-clock deadline checked at each step,
and a size cap on every string or list the template builds and on its output.
"""
from __future__ import annotations

import contextvars
import json
import logging
import re
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterator, Literal, Optional

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
import jinja2.visitor
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

ContentFormat = Literal["string", "openai"]


def _jinja_version_ok() -> bool:
    parts = []
    for piece in jinja2.__version__.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) >= (3, 1, 6)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged.
    transformers uses the tag to find assistant tokens for training masks; templates
    that carry it must still parse and render the same here."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller) -> str:
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters and takes no indent/separators;
    # templates are written against transformers' json.dumps version.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    # Looks ``datetime`` up at call time, so tests can freeze the clock.
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore-prefixed attributes (CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - Jinja's signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        _check_result(value)  # {% set ns.s = ns.s ~ ns.s %} doubling in a loop
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")



# --- render limits ---------------------------------------------------------------

@dataclass(frozen=True)
class RenderLimits:
    """What one render may spend.  ``max_steps``: loop iterations plus calls (the real
    templates in tests/support/data/chat_templates take a few per message); ``timeout_s``: wall
    clock, checked at every step, so a render that cannot finish stops within a step of
    its deadline; ``max_chars``: the largest string/list the template may build and its
    output (the gateway passes --max-prompt-chars: a longer prompt is refused anyway)."""

    max_steps: int = 1_000_000
    timeout_s: float = 5.0
    max_chars: int = 8 * 1024 * 1024
    # Lists / tuples / dicts: one filter on a list (sort, unique, join) is one step, so
    # its length bounds how long that step holds the GIL.
    max_items: int = 1_000_000


class RenderLimitExceeded(Exception):
    """A render hit one of its RenderLimits; the message names the limit.  Not a
    TemplateError, so nothing in Jinja or the template can catch it."""


class _Budget:
    __slots__ = ("steps", "deadline", "limits")

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self.steps = limits.max_steps
        self.deadline = time.monotonic() + limits.timeout_s

    def charge(self, n: int = 1) -> None:
        self.steps -= n
        if self.steps < 0:
            raise RenderLimitExceeded(
                f"The chat template exceeded its budget of {self.limits.max_steps} steps (loop iterations and "
                f"calls); it loops too much for this request.")
        if time.monotonic() > self.deadline:
            raise RenderLimitExceeded(
                f"The chat template took longer than the render time limit of {self.limits.timeout_s:g} s "
                f"(--chat-template-timeout).")

    def check_size(self, size: int, what: str) -> None:
        if size > self.limits.max_chars:
            raise RenderLimitExceeded(
                f"The chat template would build {what} of length {size}, over the limit of "
                f"{self.limits.max_chars} characters (--max-prompt-chars).")

    def check_items(self, size: int) -> None:
        if size > self.limits.max_items:
            raise RenderLimitExceeded(f"The chat template would build a list of {size} items, over the limit of "
                                      f"{self.limits.max_items}.")

    def check_value_size(self, value: Any, what: str, size: int) -> None:
        """``size``: the length ``value`` (a str, or a list/tuple/dict) would have."""
        if isinstance(value, str):
            self.check_size(size, what)
        else:
            self.check_items(size)


# Renders run in executor threads, several at once: each has its own budget.
_BUDGET: contextvars.ContextVar[Optional[_Budget]] = contextvars.ContextVar("tokserve_template_budget",
                                                                             default=None)


def _budget() -> Optional[_Budget]:
    return _BUDGET.get()


def _check_result(value: Any) -> Any:
    budget = _budget()
    if budget is not None:
        if isinstance(value, str):
            budget.check_size(len(value), "a value")
        elif isinstance(value, (list, tuple, dict)):
            budget.check_items(len(value))
    return value


def _check_ints(budget: _Budget, values) -> None:
    """Width, count and fill arguments (center(10**9), '%*d', zfill ...) are refused
    before the allocation they would ask for."""
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and v > budget.limits.max_chars:
            budget.check_size(v, "a value")


# Widths and precisions: "%-10.3f" (printf style) and "{:>10.3}" (str.format specs).
_PERCENT_SPEC = re.compile(r"%[-+ #0]*(\d*)(?:\.(\d+))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
_SPEC_NUMBER = re.compile(r"\d+")
_NESTED_SPEC = re.compile(r"\{[^{}]*:[^{}]*\{")


def _check_format_widths(budget: _Budget, fmt: str) -> None:
    """'%1000000000s' % x and '{:>1000000000}'.format(x): a width or precision in the
    format string over the cap (numbers elsewhere in the text are not widths)."""
    numbers = [n for m in _PERCENT_SPEC.finditer(fmt) for n in m.groups() if n]
    numbers += [n for m in _BRACE_SPEC.finditer(fmt) for n in _SPEC_NUMBER.findall(m.group(1))]
    for n in numbers:
        # Past 12 digits the int() itself would be the cost (and Python refuses 4300+).
        if len(n) > 12 or int(n) > budget.limits.max_chars:
            raise RenderLimitExceeded(
                f"The chat template formats a value {n[:20]}{'...' if len(n) > 20 else ''} wide, over the "
                f"limit of {budget.limits.max_chars} characters (--max-prompt-chars).")


def _replace_size(s: str, old: str, new: str, count: int = -1) -> int:
    hits = len(s) + 1 if old == "" else s.count(old)
    if count is not None and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


def _join_size(sep: str, items) -> Optional[int]:
    if not isinstance(items, (list, tuple)):
        return None  # a generator: its items are charged as they are made; the result is checked after
    return len(sep) * max(len(items) - 1, 0) + sum(len(x) if isinstance(x, str) else 8 for x in items)


def _precheck_str_method(budget: _Budget, obj: Any, args: tuple, kwargs: dict) -> None:
    # The sandbox hands out str.format wrapped (wrap_str_format); the original is __wrapped__.
    obj = getattr(obj, "__wrapped__", obj)
    owner = getattr(obj, "__self__", None)
    if not isinstance(owner, str):
        return
    name = getattr(obj, "__name__", "")
    if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
        _check_ints(budget, list(args) + list(kwargs.values()))
        if name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(tab, int):
                budget.check_size(len(owner) + owner.count("\t") * max(tab, 0), "a string")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        budget.check_size(_replace_size(owner, args[0], args[1], args[2] if len(args) > 2 else -1), "a string")
    elif name == "join" and args:
        size = _join_size(owner, args[0])
        if size is not None:
            budget.check_size(size, "a string")
    elif name in ("format", "format_map"):
        _check_format_widths(budget, owner)
        if _NESTED_SPEC.search(owner):  # '{0:{1}}': a width taken from the arguments
            _check_ints(budget, list(args) + list(kwargs.values()))


# Filters whose int arguments are widths or counts of what they build.
_SIZED_FILTERS = frozenset({"center", "indent", "wordwrap", "batch", "slice", "tojson", "truncate"})


def _guard_filter(name: str, func):
    """A filter wrapped to charge a step, refuse size arguments over the cap before
    running and check what it returns (filters are called directly, not through the
    sandbox's call())."""

    def guarded(*args, **kwargs):
        budget = _budget()
        if budget is None:
            # Jinja evaluates filters on literals while compiling ({{ 'x'|center(10**9) }}
            # would allocate then, outside every limit); failing here makes it leave them
            # to the render, and renders always run under render_limited.
            raise RuntimeError("chat template filters run only inside render_limited()")
        budget.charge()
        # Filters taking an environment/context get it first; the piped value follows.
        rest = [a for a in args if not isinstance(a, (jinja2.Environment, jinja2.runtime.Context,
                                                      jinja2.nodes.EvalContext))]
        value, extra = (rest[0], rest[1:]) if rest else (None, [])
        if name in _SIZED_FILTERS:
            _check_ints(budget, list(extra) + list(kwargs.values()))
        if name == "indent" and isinstance(value, str):
            width = extra[0] if extra else kwargs.get("width", 4)
            width = len(width) if isinstance(width, str) else width
            if isinstance(width, int):
                budget.check_size(len(value) + (value.count("\n") + 1) * max(width, 0), "a string")
        elif name == "replace" and isinstance(value, str) and len(extra) >= 2:
            old, new = str(extra[0]), str(extra[1])
            count = extra[2] if len(extra) > 2 else kwargs.get("count")
            budget.check_size(_replace_size(value, old, new, count if isinstance(count, int) else -1),
                              "a string")
        elif name == "join" and isinstance(value, (list, tuple)):
            sep = extra[0] if extra else kwargs.get("d", "")
            size = _join_size(str(sep), value)
            if size is not None:
                budget.check_size(size, "a string")
        elif name == "tojson":
            # Each line of the output gets indent x depth spaces.
            indent = kwargs.get("indent", extra[1] if len(extra) > 1 else None)
            if isinstance(indent, int) and indent > 64:
                raise RenderLimitExceeded(f"The chat template asks tojson for an indent of {indent}; at most "
                                          f"64 is allowed.")
        elif name == "wordwrap":
            wrap = kwargs.get("wrapstring", extra[3] if len(extra) > 3 else None)
            if isinstance(wrap, str) and len(wrap) > 16:
                raise RenderLimitExceeded("The chat template asks wordwrap for a wrapstring over 16 characters.")
        elif name == "sum" and isinstance(value, (list, tuple)):
            start = kwargs.get("start", extra[1] if len(extra) > 1 else 0)
            if isinstance(start, (str, list, tuple)):  # summing sequences: concatenation
                total = len(start) + sum(len(x) for x in value if isinstance(x, (str, list, tuple)))
                budget.check_value_size(start, "a value", total)
        elif name == "format" and isinstance(value, str):
            _check_format_widths(budget, value)
            if "*" in value:  # "%*d": the width is an argument
                _check_ints(budget, list(extra) + list(kwargs.values()))
        return _check_result(func(*args, **kwargs))

    guarded.__name__ = getattr(func, "__name__", name)
    # Keep Jinja's pass_context / pass_environment / pass_eval_context marker.
    if hasattr(func, "jinja_pass_arg"):
        guarded.jinja_pass_arg = func.jinja_pass_arg
    return guarded


class _CountedIterable:
    """A for loop's iterable: each item charges one step.  Keeps len() so that
    ``loop.length`` / ``loop.last`` work as before."""

    __slots__ = ("_items",)

    def __init__(self, items):
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        budget = _budget()
        for item in self._items:
            if budget is not None:
                budget.charge()
            yield item


def _loop_budget(items):
    return _CountedIterable(items)


def _checked_join(parts) -> str:
    """The environment's ``concat``: how ``{% set x %}...{% endset %}`` blocks, macros
    and ``caller()`` bodies join what they wrote; sized before joining, so doubling
    through a block set in a recursive macro stops at the cap."""
    parts = parts if isinstance(parts, list) else list(parts)
    budget = _budget()
    if budget is not None:
        budget.charge()
        budget.check_size(sum(len(p) for p in parts), "a string")
    return "".join(parts)


def _concat(*values) -> str:
    """Jinja's ``~``, sized before it joins (it is not an interceptable operator)."""
    parts = [str(v) for v in values]
    budget = _budget()
    if budget is not None:
        budget.charge()
        budget.check_size(sum(len(p) for p in parts), "a string")
    return "".join(parts)


class _Budgeted(jinja2.visitor.NodeTransformer):
    """Every ``{% for %}``'s iterable goes through _loop_budget, so nested loops over
    plain lists are counted too, not only ``range`` ones; every ``~`` goes through
    _concat, so doubling a string in a loop stops at the size cap."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("tokserve_loop_budget"), [node.iter], [], None, None,
                               lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return nodes.Call(nodes.EnvironmentAttribute("tokserve_concat"), list(node.nodes), [], None, None,
                          lineno=node.lineno)


def _wrap_loops(ast: nodes.Template) -> nodes.Template:
    return _Budgeted().visit(ast)


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    # Intercepted operators are never constant-folded (and the environment folds
    # nothing: optimized=False), so {{ 'a' * 10**9 }} cannot allocate while compiling.
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        budget = _budget()
        if budget is not None:
            budget.charge()
            _precheck_str_method(budget, __obj, args, kwargs)
        return _check_result(ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        budget = _budget()
        if budget is not None:
            budget.charge()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        budget.check_value_size(seq, "a repeated value", len(seq) * max(n, 0))
            elif operator == "**":
                if (isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0
                        and right * abs(left).bit_length() > 64 * 1024):
                    raise RenderLimitExceeded(f"The chat template computes {left} ** {right}, a number over "
                                              f"{64 * 1024} bits.")
            elif operator == "+":
                if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                    budget.check_value_size(left, "a value", len(left) + len(right))
            elif operator == "%" and isinstance(left, str):
                _check_format_widths(budget, left)
                if "*" in left:  # '%*d' % (width, x)
                    _check_ints(budget, right if isinstance(right, tuple) else (right,))
        return _check_result(self.binop_table[operator](left, right))


# Longest line (paragraph) wordwrap wraps.  textwrap chops a word longer than the width
# one slice at a time, each a copy of the rest: quadratic (one 300k-character word at
# width 1 took 5 s, past every step check).  At this length a line costs milliseconds.
WORDWRAP_MAX_LINE = 16 * 1024


@jinja2.pass_environment
def _wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    """Jinja's ``wordwrap`` (same output: each line wrapped by textwrap on its own and
    joined with ``wrapstring``) with a step per line, so that a million short lines stop
    at the step budget or the deadline, and lines over WORDWRAP_MAX_LINE refused."""
    import textwrap

    budget = _budget()
    if wrapstring is None:
        wrapstring = environment.newline_sequence
    s = str(s)
    wrapped = []
    for line in s.splitlines():
        if budget is not None:
            budget.charge()
        if len(line) > WORDWRAP_MAX_LINE:
            raise RenderLimitExceeded(f"The chat template asks wordwrap to wrap a line of {len(line)} characters; "
                                      f"at most {WORDWRAP_MAX_LINE} are allowed.")
        wrapped.append(wrapstring.join(textwrap.wrap(line, width=width, expand_tabs=False, replace_whitespace=False,
                                                     break_long_words=break_long_words,
                                                     break_on_hyphens=break_on_hyphens)))
    return wrapstring.join(wrapped)


def _environment() -> ImmutableSandboxedEnvironment:
    # optimized=False: no constant folding, which would run filters and operators on
    # literals at compile time, outside every limit ({{ 'x'|center(1000000000) }}); the
    # code generator still tries that for {{ }} output, which _guard_filter refuses.
    env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True, optimized=False,
                          extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters["wordwrap"] = _wordwrap
    for name, func in list(env.filters.items()):
        env.filters[name] = _guard_filter(name, func)
    lipsum = env.globals["lipsum"]

    def guarded_lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 - Jinja's parameter names
        # Jinja's lorem ipsum generator loops n x max words in one call, outside the step budget.
        budget = _budget()
        if budget is not None:
            budget.charge()
            for v in (n, min, max):
                if not isinstance(v, int) or v > 1000:
                    raise RenderLimitExceeded("lipsum() takes at most 1000 paragraphs of at most 1000 words "
                                              "in a chat template.")
        return lipsum(n=n, html=html, min=min, max=max)

    env.globals["lipsum"] = guarded_lipsum
    env.tokserve_loop_budget = _loop_budget
    env.tokserve_concat = _concat
    env.concat = _checked_join
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _environment() if _jinja_version_ok() else None


def _env() -> ImmutableSandboxedEnvironment:
    if _ENV is None:
        raise ImportError(f"chat templates need jinja2>=3.1.6 (older versions have sandbox escapes); "
                          f"found {jinja2.__version__}")
    return _ENV


# Requests may carry their own template, so the caches are bounded.
@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Raises jinja2.TemplateSyntaxError for a template that does not parse."""
    env = _env()
    code = env.compile(_wrap_loops(env.parse(source)))
    return env.template_class.from_code(env, code, env.make_globals(None), None)


def render_limited(template: jinja2.Template, limits: RenderLimits, **context) -> str:
    """``template.render(**context)`` under ``limits``; raises RenderLimitExceeded."""
    token = _BUDGET.set(_Budget(limits))
    try:
        budget = _BUDGET.get()
        parts, size = [], 0
        # generate(): the output is checked as it grows, not once it is all built.
        for piece in template.generate(**context):
            size += len(piece)
            if size > limits.max_chars:
                raise RenderLimitExceeded(
                    f"The chat template's output exceeds the limit of {limits.max_chars} characters "
                    f"(--max-prompt-chars).")
            parts.append(piece)
            budget.charge()
        return "".join(parts)
    finally:
        _BUDGET.reset(token)


@lru_cache(maxsize=32)
def template_variables(source: str) -> frozenset[str]:
    """Names the template reads but never sets: what vLLM lets through from
    chat_template_kwargs (``jinja2.meta.find_undeclared_variables``)."""
    return frozenset(jinja2.meta.find_undeclared_variables(_env().parse(source)))


def supports_developer_role(source: str) -> bool:
    """vLLM's test: a template that never names "developer" gets developer messages
    as system messages."""
    return '"developer"' in source or "'developer'" in source


# --- content format: a port of vLLM's renderers/hf.py AST walk -------------------
# A template that iterates ``message['content']`` (directly, through a variable
# assigned from it, or through a macro parameter bound to it) expects the OpenAI list
# of parts; any other template gets the parts joined into one string.

def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == varname


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (_is_var_access(node.node, varname) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == key)
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _names_assigned_from(root: jinja2.nodes.Node, varname: str) -> Iterator[str]:
    yield varname
    pending = deque([varname])
    while pending:
        name = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems_access(assign.node, name) and isinstance(assign.target, jinja2.nodes.Name):
                yield assign.target.name
                if assign.target.name != name:  # self-assignment would loop forever
                    pending.append(assign.target.name)


def _message_loop_vars(root: jinja2.nodes.Node) -> Iterator[str]:
    messages_names = list(_names_assigned_from(root, "messages"))
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(
                _is_var_or_elems_access(loop.iter, name) for name in messages_names):
            yield loop.target.name


def _loops_over_content(root: jinja2.nodes.Node) -> bool:
    message_vars = list(_message_loop_vars(root))

    def is_content(arg) -> bool:
        return any(_is_var_or_elems_access(arg, var, "content") for var in message_vars)

    # Macro parameters that receive message.content, per loop inside that macro.
    content_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = [arg.name for arg in macro.args]
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(param_names) and is_content(arg):
                    content_params.add(param_names[i])
            for kwarg in call.kwargs:
                if kwarg.key in param_names and is_content(kwarg.value):
                    content_params.add(kwarg.key)
        for loop in macro.find_all(jinja2.nodes.For):
            loops_in_macros.add(id(loop))
            if content_params:
                content_params_by_loop[id(loop)] = content_params

    for loop in root.find_all(jinja2.nodes.For):
        if not isinstance(loop.target, jinja2.nodes.Name):
            continue
        if any(_is_var_or_elems_access(loop.iter, var, "content") for var in message_vars):
            return True
        if isinstance(loop.iter, jinja2.nodes.Name):
            if loop.iter.name in content_params_by_loop.get(id(loop), ()):
                return True
            if id(loop) not in loops_in_macros and loop.iter.name == "content":
                return True
    return False


@lru_cache(maxsize=32)
def detect_content_format(source: str) -> ContentFormat:
    """vLLM's ``_detect_content_format``: "string" when the template cannot be parsed."""
    try:
        ast = _env().parse(source)
    except Exception:  # vLLM logs and falls back to "string" too
        log.debug("chat template does not parse; assuming the string content format", exc_info=True)
        return "string"
    try:
        return "openai" if _loops_over_content(ast) else "string"
    except Exception:
        log.debug("cannot walk the chat template's syntax tree; assuming the string content format",
                  exc_info=True)
        return "string"
