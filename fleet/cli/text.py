"""Text for a terminal: what ``fleet`` prints of user data (issue 25.7).

Ids, gate names, payloads, error messages and worker names come from whoever wrote
the log or the report; printed raw, an ``ESC [`` or a lone C1 ``CSI`` in them moves
the cursor, rewrites the screen, sets the title or (OSC 8) makes a link, and BEL
rings. ``terminal_safe`` writes each such character as an escape instead. A module
of its own, with no import but the standard library, so the error path of every
command (``fleet.cli.failures``) uses it without loading rich.
"""

from __future__ import annotations

#: What ``terminal_safe`` writes as an escape: C0 controls (ESC, BEL, backspace, CR...),
#: DEL, the C1 controls (a lone 0x9b is CSI to many terminals) and the invisible
#: format characters that reorder or hide text (bidi overrides and isolates, zero
#: widths, BOM). Newline and tab stay unless ``newlines=False``.
_UNSAFE: dict[int, str] = {
    code: f"\\x{code:02x}" for code in (*range(0x20), 0x7F, *range(0x80, 0xA0))
    if code not in (0x0A, 0x09)}
_UNSAFE.update({code: f"\\u{code:04x}" for code in (
    0x061C, *range(0x200B, 0x2010), *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0xFEFF)})
_UNSAFE_LINES = {**_UNSAFE, 0x0A: "\\n", 0x09: "\\t"}


def terminal_safe(value: object, *, newlines: bool = True) -> str:
    """``value`` as text a terminal shows as it is (issue 25.7): every control or
    invisible format character written as an escape (``\\x1b``, ``\\x9b``,
    ``\\u202e``); with ``newlines=False`` newline and tab too (an id on one line)."""
    text = value if isinstance(value, str) else str(value)
    if text.isascii() and text.isprintable():
        return text
    return text.translate(_UNSAFE if newlines else _UNSAFE_LINES)


__all__ = ["terminal_safe"]
