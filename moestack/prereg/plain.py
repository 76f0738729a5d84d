"""Plain text: what the lock history and the report quote from a study file must be one line
with no control character (``check_plain``); the report shows any other as U+FFFD."""

from __future__ import annotations

import unicodedata

from moestack.errors import MoestackError

# Characters that are no plain text: controls (newline, tab, NUL, ESC...), line and paragraph
# separators, and the bidirectional controls that reorder what a reader sees.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x00": "a NUL",
                  "\x1b": "an escape (ANSI)"}  # fmt: skip


def is_control(ch: str) -> bool:
    """Whether the character ``ch`` is no plain text (a control, separator or bidi control)."""
    return unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in _BIDI


def check_plain(text: str, where: str) -> str:
    """``text`` when it holds no control character (``is_control``), else one line naming
    ``where``, the character and its place."""
    for i, ch in enumerate(text):
        if is_control(ch):
            name = _CONTROL_NAMES.get(ch, "a control character")
            raise MoestackError(
                f"{where}: {name} (U+{ord(ch):04X}) at character {i + 1}; give it as one line of "
                "plain text (the lock history and the report quote it)"
            )
    return text
