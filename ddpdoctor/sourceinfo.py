"""Control flow around a source line: the ``if``/``while``/``for`` headers that enclose it.

Used once per interned call site (never per event) so that a finding can say "rank 0 reached
train.py:112 through train.py:108 `if rank == 0:`". Files are parsed with ``ast`` once and cached.
"""

from __future__ import annotations

import ast
import linecache
import re
import threading

# (first line, last line, header line, header text, kind) for every branch body in a file.
_Block = tuple
_cache: dict[str, list[_Block] | None] = {}
_lock = threading.Lock()

#: Words that make a condition rank-dependent in the eyes of a reader.
RANK_WORDS = re.compile(
    r"\b(rank|local_rank|global_rank|get_rank|is_main|is_master|main_process|master|"
    r"is_primary|primary|leader|is_global_zero|is_local_zero|node_rank|world_size|RANK)\b",
    re.IGNORECASE,
)


def _blocks(filename: str) -> list[_Block] | None:
    with _lock:
        if filename in _cache:
            return _cache[filename]
    lines = linecache.getlines(filename)
    blocks: list[_Block] | None = None
    if lines:
        try:
            tree = ast.parse("".join(lines), filename)
        except (SyntaxError, ValueError):
            tree = None
        if tree is not None:
            blocks = []
            for node in ast.walk(tree):
                if isinstance(node, (ast.If, ast.While, ast.For, ast.AsyncFor, ast.With, ast.Try)):
                    kind = type(node).__name__.lower()
                    head = lines[node.lineno - 1].strip() if node.lineno <= len(lines) else ""
                    body = getattr(node, "body", [])
                    if body:
                        blocks.append((body[0].lineno, body[-1].end_lineno or body[-1].lineno,
                                       node.lineno, head, kind))
                    orelse = getattr(node, "orelse", [])
                    if orelse and kind in ("if", "while", "for"):
                        first = orelse[0]
                        # An `elif` is its own If node; a plain else gets the parent's header.
                        if not (len(orelse) == 1 and isinstance(first, ast.If) and
                                lines[first.lineno - 1].lstrip().startswith("elif")):
                            blocks.append((first.lineno, orelse[-1].end_lineno or orelse[-1].lineno,
                                           node.lineno, "else of: " + head, kind + "-else"))
    with _lock:
        _cache[filename] = blocks
    return blocks


def enclosing(filename: str, line: int) -> list[list]:
    """Branch headers enclosing ``line``, outermost first: ``[[line, text, kind], ...]``."""
    blocks = _blocks(filename)
    if not blocks:
        return []
    found = [b for b in blocks if b[0] <= line <= b[1] and b[4] not in ("with", "try")]
    found.sort(key=lambda b: (b[2], -b[1]))
    return [[b[2], b[3], b[4]] for b in found]


def conditions_for_stack(frames: list[tuple[str, int]]) -> list[list]:
    """For each frame (innermost first), its enclosing branches: ``[[file, line, text, kind]]``."""
    out: list[list] = []
    for filename, line in frames:
        for cline, text, kind in enclosing(filename, line):
            out.append([filename, cline, text, kind])
    return out


def is_rank_dependent(text: str) -> bool:
    return bool(RANK_WORDS.search(text))
