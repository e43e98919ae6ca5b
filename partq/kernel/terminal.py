"""Text from outside (keys, member ids, etcd key names, error texts) made safe to print.

A key or an etcd name may hold terminal escape sequences: printed raw, they can recolour,
retitle or rewrite what an operator sees. Every text printer passes what it prints through
:func:`printable` (``partq status``, ``partq dlq``, error lines).
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["one_line", "printable"]

# Bidirectional overrides and isolates reorder what is shown ("Trojan source").
_BIDI = frozenset("\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})  # controls, lone surrogates, breaks
_ANY_UNSAFE = re.compile(r"[^\x20-\x7e]")  # a quick pass: plain ASCII needs no look-up


def _unsafe(char: str) -> bool:
    return char in _BIDI or unicodedata.category(char) in _UNSAFE_CATEGORIES


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with control characters (C0, DEL, C1, tab and newline too), line and
    paragraph separators, bidi controls and lone surrogates written as ``\\xNN`` or
    ``\\uNNNN``; everything else, other scripts and emoji included, as it is."""
    if not _ANY_UNSAFE.search(text):
        return text
    return "".join(_escape(c) if _unsafe(c) else c for c in text)


def one_line(text: str) -> str:
    """``text`` on one printable line: its lines and runs of blanks joined by one space,
    then :func:`printable`."""
    return printable(" ".join(text.split()))
