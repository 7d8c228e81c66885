"""Checks of prompt text shared by the server and the command line (no third-party imports).

Each returns ``None`` for usable text, else a phrase that follows the text's name in an
error message (``"PROMPT is only whitespace"``, ``"messages[0].content is not valid Unicode
..."``).
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def blank_problem(text: str) -> str | None:
    """``"is empty"`` or ``"is only whitespace"`` (nothing to answer), else ``None``."""
    if not text:
        return "is empty"
    if text.isspace():
        return "is only whitespace"
    return None


def encoding_problem(text: str) -> str | None:
    """Where ``text`` is not valid Unicode (an encoding error): a lone surrogate, as JSON's
    ``"\\ud800"`` escape gives, or as Python reads a command-line byte that is not UTF-8
    (U+DC80..U+DCFF); else ``None``."""
    m = _SURROGATE.search(text)
    if m is None:
        return None
    code = ord(m.group())
    byte = f" (how Python reads a byte 0x{code - 0xDC00:02X} that is not UTF-8)" if 0xDC80 <= code <= 0xDCFF else ""
    return (f"is not valid Unicode text (an encoding error): character {m.start()} is a lone surrogate "
            f"U+{code:04X}{byte}")
