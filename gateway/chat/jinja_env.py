"""The Jinja environment chat templates are rendered in, built as transformers builds
it (``utils/chat_template_utils._compile_jinja_template``), plus the two questions
vLLM asks of a template's syntax tree: which variables it reads, and whether it loops
over a message's content (the "openai" content format) or not ("string").

Templates come from model repositories or requests, so they are untrusted code: the
immutable sandbox, the restricted ``dict``/``namespace`` globals and jinja2>=3.1.6 are
transformers' defences and are kept here for the same reason.
"""
from __future__ import annotations

import json
import logging
from collections import deque
from datetime import datetime
from functools import lru_cache
from typing import Iterator, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
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
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
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
    return _env().from_string(source)


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
