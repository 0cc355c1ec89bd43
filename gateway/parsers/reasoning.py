"""Reasoning parsers (vLLM 0.32 ``--reasoning-parser deepseek_r1`` / ``qwen3``) as pure functions.

Each splitter takes the decoded output text and returns ``(reasoning, content)``.  With
``final=True`` the result is what vLLM's non-streaming path returns; with ``final=False`` the
text is a streaming prefix and anything that could still turn into a tag (``"<thi"``,
``"</thin"``, ``"<tool_ca"``) is held back, so that successive calls only ever grow both fields.

deepseek_r1 -- vLLM ``reasoning/deepseek_r1_reasoning_parser.py`` on ``basic_parsers.py``
(``BaseThinkingReasoningParser.extract_reasoning``):
  * the output is partitioned at the FIRST ``<think>`` (text before it is dropped); without one
    the whole output is the candidate (R1's template pre-opens ``<think>``);
  * no ``</think>`` -> everything is reasoning, content None; otherwise reasoning is the text
    before the first ``</think>`` and content the rest (``None`` when empty).  Reasoning is a
    str even when empty (``"</think>x"`` -> ``("", "x")``), as vLLM returns it.

qwen3 -- vLLM 0.32 serves it from the declarative parser engine (``parser/qwen3.py``,
``parser/engine/{parser_engine,streaming_parser_engine,incremental_lexer}.py``; the reasoning
adapter runs it with ``skip_tool_parsing``).  Text is lexed leftmost-longest into terminals and
run through a state machine that starts in REASONING (thinking enabled):
  * REASONING: ``<think>`` dropped; ``</think>`` -> CONTENT (dropped); ``<tool_call>`` ends
    reasoning implicitly and stays in the content (for the tool parser); other text reasoning;
  * CONTENT: a stray ``</think>`` is dropped; everything else (``<think>`` included) is content;
  * the tokenizer's other special tokens (``all_special_tokens`` minus the grammar's own) are
    dropped in both states (``_build_drop_info``) -- pass them as ``drop_tokens``;
  * an output without ``</think>`` is ALL reasoning (0.32's engine; the old pre-engine qwen3
    parser returned it as content); reasoning/content are ``None`` when empty; reasoning is not
    stripped (``strip_trailing_reasoning_whitespace=False`` in ``qwen3_config``).
  With ``enable_thinking=False`` vLLM's ``Qwen3Parser.extract_reasoning`` returns
  ``(None, output)`` untouched -- that is the caller passing ``reasoning_open=False``.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"

# qwen3_config's terminals (parser/qwen3.py).  Those without a transition in the REASONING /
# CONTENT states are emitted verbatim; the scan only looks for them where one could overlap a
# terminal that acts (see _lexer), so it still splits the text exactly as vLLM's lexer does.
_QWEN3_TERMINALS = (THINK_START, THINK_END, TOOL_CALL_START, "</tool_call>", "<function=",
                    "</function>", "<parameter=", "</parameter>", ">")
_QWEN3_TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")


def partial_suffix_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``
    (vLLM ``tool_parsers/utils.partial_tag_overlap``, over several tags)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


# ---------------------------------------------------------------------------- deepseek_r1

def split_deepseek_r1(text: str, *, final: bool) -> tuple[str | None, str | None]:
    """``BaseThinkingReasoningParser.extract_reasoning`` (final) / its prefix-safe stream form.

    Streaming (``final=False``) commits early to one reading of the start tag: while the
    (left-stripped) text could still become ``<think>`` nothing is released; once it starts
    with ``<think>`` the text after it is used, otherwise the text as is.  A ``<think>`` that
    first appears LATER (after other output) is treated as plain text while streaming, but
    vLLM's non-streaming partition moves the whole split to it (the earlier text disappears),
    so the final result then is not an extension of what was streamed -- the one place the
    deepseek_r1 stream is not prefix-consistent (vLLM's own token-id based streaming does not
    reproduce its non-stream result there either).
    """
    if final:
        before, sep, after = text.partition(THINK_START)
        body = after if sep else before
    else:
        stripped = text.lstrip()
        if len(stripped) < len(THINK_START) and THINK_START.startswith(stripped):
            return None, None  # could still be (whitespace +) "<think>"
        body = text.partition(THINK_START)[2] if stripped.startswith(THINK_START) else text
    reasoning, sep, content = body.partition(THINK_END)
    if sep:
        return reasoning, content or None
    if not final:
        reasoning = reasoning[:len(reasoning) - partial_suffix_len(reasoning, (THINK_END,))]
    return reasoning, None


def deepseek_r1_reasoning_open(prompt_text: str) -> bool:
    """``not BaseThinkingReasoningParser.is_reasoning_end(prompt_ids)``: scanning the prompt
    backwards, a ``<think>`` (or no marker at all) leaves reasoning open, a ``</think>`` closes it."""
    return prompt_text.rfind(THINK_END) < 0 or prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


# ---------------------------------------------------------------------------- qwen3

def _overlaps(v: str, a: str) -> bool:
    """Whether a match of ``v`` could cover the start of (or equal a prefix of) ``a``."""
    return any(v[k:].startswith(a) or a.startswith(v[k:]) for k in range(len(v)))


@functools.lru_cache(maxsize=64)
def _lexer(acting: tuple[str, ...], verbatim: tuple[str, ...]) -> re.Pattern[str]:
    """Leftmost-longest matcher of the ``acting`` terminals, as vLLM's IncrementalLexer finds them
    among all terminals.  A verbatim terminal matters only if its match could hide an acting one
    (covering its start), directly or through another such terminal -- none of qwen3's do, so
    the matcher runs at C speed over text full of ``>``."""
    wanted = set(acting)
    changed = True
    while changed:
        changed = False
        for v in verbatim:
            if v not in wanted and any(_overlaps(v, w) for w in wanted):
                wanted.add(v)
                changed = True
    return re.compile("|".join(re.escape(t) for t in sorted(wanted, key=len, reverse=True)))


def split_qwen3(text: str, *, final: bool,
                drop_tokens: Iterable[str] = ()) -> tuple[str | None, str | None]:
    """The qwen3 parser engine's ``extract_reasoning`` starting in REASONING (see module doc)."""
    drops = tuple(dict.fromkeys(t for t in drop_tokens if t and t not in _QWEN3_TERMINALS))
    terminals = _QWEN3_TERMINALS + drops
    acting_r = (THINK_START, THINK_END, TOOL_CALL_START) + drops
    acting_c = (THINK_END,) + drops
    lexer_r = _lexer(acting_r, tuple(t for t in terminals if t not in acting_r))
    lexer_c = _lexer(acting_c, tuple(t for t in terminals if t not in acting_c))
    reasoning: list[str] = []
    content: list[str] = []
    in_reasoning = True
    pos = 0
    while True:
        acting, lexer = (acting_r, lexer_r) if in_reasoning else (acting_c, lexer_c)
        out = reasoning if in_reasoning else content
        m = lexer.search(text, pos)
        while m is not None and m.group() not in acting:  # a verbatim terminal: plain text
            m = lexer.search(text, m.end())
        if m is None:
            rest = text[pos:]
            if not final:
                rest = rest[:len(rest) - partial_suffix_len(rest, acting)]
            out.append(rest)
            break
        term = m.group()
        out.append(text[pos:m.start()])
        pos = m.end()
        if term in drops:
            continue
        if in_reasoning:
            if term == THINK_END:
                in_reasoning = False
            elif term == TOOL_CALL_START:
                # implicit end of reasoning; with skip_tool_parsing the tag is content text
                in_reasoning = False
                content.append(term)
            # THINK_START: (REASONING, THINK_START) -> REASONING, no events: dropped
        # CONTENT: a duplicate </think> after reasoning ended is absorbed (the only acting one)
    return "".join(reasoning) or None, "".join(content) or None


def qwen3_thinking_enabled(chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """``Qwen3Parser``: ``chat_template_kwargs.get("enable_thinking", True)``, by truthiness."""
    return bool((chat_template_kwargs or {}).get("enable_thinking", True))


def qwen3_reasoning_open(prompt_text: str, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """``not ParserEngine.is_reasoning_end(prompt_ids)`` for the qwen3 config.

    Only the last turn counts (after the last ``<|im_start|>``/``<|im_end|>``); in it the last
    of ``</think>``/``<tool_call>`` (reasoning-end terminals) closes reasoning, a ``<think>`` or
    no marker leaves it open -- when thinking is enabled.  With ``enable_thinking=False`` the
    engine starts in CONTENT and never waits for reasoning: always closed.
    """
    if not qwen3_thinking_enabled(chat_template_kwargs):
        return False
    turn_start = max(prompt_text.rfind(b) + len(b) if prompt_text.rfind(b) >= 0 else 0
                     for b in _QWEN3_TURN_BOUNDARIES)
    last_turn = prompt_text[turn_start:]
    last_end = max(last_turn.rfind(THINK_END), last_turn.rfind(TOOL_CALL_START))
    return last_end < 0 or last_turn.rfind(THINK_START) > last_end
