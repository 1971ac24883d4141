"""Control flow around a source line: the ``if``/``while``/``for`` headers that enclose it.

Used once per interned call site (never per event) so that a finding can say "rank 0 reached
train.py:112 through train.py:108 `if rank == 0:`". Files are parsed with ``ast`` once and cached.
"""

from __future__ import annotations

import ast
import linecache
import os
import stat
import threading

# (first line, last line, header line, header text, kind) for every branch body in a file.
_Block = tuple
_cache: dict[str, list[_Block] | None] = {}
_lock = threading.Lock()


#: Largest source file read (the report reads files named by a trace, which is untrusted input).
MAX_SOURCE_BYTES = 4 << 20
_SOURCE_SUFFIXES = (".py", ".pyw")


def source_lines(filename: str) -> list[str]:
    """The lines of a Python source file, or [] unless it plausibly is one of the traced
    program's sources: a regular file (never a FIFO or a device such as /dev/zero), at most
    MAX_SOURCE_BYTES, named *.py. A trace read by ``report`` names files; a hostile or
    damaged one must not make it read, or quote, anything else."""
    if not isinstance(filename, str) or not filename.endswith(_SOURCE_SUFFIXES):
        return []
    try:
        st = os.stat(filename)
    except (OSError, ValueError):
        return []
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SOURCE_BYTES:
        return []
    return linecache.getlines(filename)


def _blocks(filename: str) -> list[_Block] | None:
    with _lock:
        if filename in _cache:
            return _cache[filename]
    lines = source_lines(filename)
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
    if not isinstance(line, int):  # a frame's f_lineno is None on an instruction without a line
        return []
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


def loop_exits(filename: str, loop_line: int) -> list[list]:
    """Early exits of the loop whose header is at ``loop_line``: ``break`` (not of an inner
    loop), ``return`` and ``raise`` statements in its body, each with the innermost ``if`` that
    guards it: ``[[line, statement, if_line, if_text], ...]``. Read when a finding is made."""
    lines = source_lines(filename)
    if not lines:
        return []
    try:
        tree = ast.parse("".join(lines), filename)
    except (SyntaxError, ValueError):
        return []
    loop = next((n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While, ast.AsyncFor))
                 and n.lineno == loop_line), None)
    if loop is None:
        return []
    out: list[list] = []

    def visit(node, guard, in_inner_loop):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            g = guard
            if isinstance(child, ast.If):
                g = (child.lineno, lines[child.lineno - 1].strip())
            inner = in_inner_loop or isinstance(child, (ast.For, ast.While, ast.AsyncFor))
            if isinstance(child, (ast.Return, ast.Raise)) or (isinstance(child, ast.Break) and not in_inner_loop):
                text = lines[child.lineno - 1].strip()
                out.append([child.lineno, text, g[0] if g else 0, g[1] if g else ""])
            visit(child, g, inner)

    for stmt in loop.body:
        visit(ast.Module(body=[stmt], type_ignores=[]), None, False)
        if isinstance(stmt, (ast.Return, ast.Raise, ast.Break)):
            out.append([stmt.lineno, lines[stmt.lineno - 1].strip(), 0, ""])
    return out[:5]
