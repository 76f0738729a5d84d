"""Quoting and number formatting for the study report: ``md`` shows any string from the study
file or the lock as Markdown text that cannot make structure, ``fmt`` a number as the report's
tables write it, ``verdict_text`` a pass/fail/inconclusive cell."""

from __future__ import annotations

import math
import re
from typing import Any

from moestack.prereg.plain import is_control

# Markdown's structure characters, backslash-escaped wherever a quoted string holds them.
_ESCAPE = frozenset("\\`*_[]<>|~$&#")
_SPACES = frozenset("\n\r\t\v\f\x85\u2028\u2029")
_LINE_START = re.compile(r"^(?:([-+=])|(\d+)([.)]))")  # a list item, a setext underline


def md(value: Any, *, code: bool = False) -> str:
    """``value`` (any string the study file or the lock holds) as Markdown text that shows it
    and cannot make structure, wherever the report quotes it: in a line or a table cell.

    Newlines, tabs and other line breaks become spaces and other control characters (NUL,
    ANSI escapes, bidirectional controls) U+FFFD, so nothing starts a line; the ends are
    stripped (no indented code block). Markdown's punctuation (backslash, backticks, ``*``,
    ``_``, ``[``, ``]``, ``<``, ``>``, ``|``, ``~``, ``$``, ``&``, ``#``) is backslash-escaped,
    but for ``_`` between letters or digits (``top_k``: no emphasis), and so is a leading
    ``-``, ``+``, ``=`` or ``1.``. ``code``: a code span instead, its fence longer than any
    backtick run inside and ``|`` escaped (as a table cell needs even there)."""
    text = "".join(
        " " if ch in _SPACES else ("\ufffd" if is_control(ch) else ch) for ch in str(value)
    ).strip()
    if code:
        if not text:
            return ""
        text = text.replace("|", "\\|")
        fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
        pad = " " if text.startswith("`") or text.endswith("`") else ""
        return f"{fence}{pad}{text}{pad}{fence}"
    out = []
    for i, ch in enumerate(text):
        inside_word = 0 < i < len(text) - 1 and text[i - 1].isalnum() and text[i + 1].isalnum()
        out.append("\\" + ch if ch in _ESCAPE and not (ch == "_" and inside_word) else ch)
    return _LINE_START.sub(lambda m: f"\\{m[1]}" if m[1] else f"{m[2]}\\{m[3]}", "".join(out), 1)


def fmt(value: Any, digits: int = 4, pct: bool = False, pp: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if pct:
        return f"{100 * value:+.1f}%"
    if pp:  # a distance between two percentages: percentage points
        return f"{100 * value:+.1f} pp"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def verdict_text(ok: bool | None, inconclusive: bool = False) -> str:
    if ok is None:
        return "inconclusive" if inconclusive else "n/a"
    return "pass" if ok else "fail"
