"""Text from traces on its way out: trace content is untrusted (a damaged or hostile file).

A terminal must not receive its control sequences (an escape sequence can rewrite the screen or
the window title), and no output stream may fail on a lone surrogate that ``json.loads``
accepted from a ``\\ud800`` escape.
"""

from __future__ import annotations

import re

# C0 controls except tab and newline, DEL, C1 controls (ESC-less CSI is 0x9b).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def valid_unicode(text: str) -> str:
    """``text`` with lone surrogates replaced, so it encodes as UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def for_terminal(text: str) -> str:
    """``text`` safe to print: valid Unicode, control characters (but tab and newline) shown
    as ``?``."""
    return _CONTROL.sub("?", valid_unicode(text))
