"""The index sets of ``cov`` records (rank/patches/coverage.py), decoded and compared.

An index set is the sorted distinct base-dataset indices a rank drew in one pass, delta-encoded
(``array`` code ``I`` or ``q``), zlib-compressed, base64; with ``rate`` r > 0 only the indices
whose 24-bit multiplicative hash is below 2**(24 - r) are kept (the same indices on every rank):
counts within that sample are exact and scaled by 2**r.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from array import array
from itertools import accumulate

HBITS = 24
_KNUTH = 2654435761
#: Most bytes one decoded set may take (a hostile or corrupt trace cannot exhaust memory).
MAX_DECODED = 64 << 20


def index_hash(i: int) -> int:
    """The rank side's hash of an index (``coverage.hash_indices``), one at a time."""
    return ((i * _KNUTH) & 0xFFFFFFFF) >> (32 - HBITS)


def decode(text) -> list[int] | None:
    """The sorted indices of an ``ix`` field, or None when it cannot be read."""
    if not isinstance(text, str) or len(text) < 2 or text[0] not in "Iq":
        return None
    try:
        d = zlib.decompressobj()
        raw = d.decompress(base64.b64decode(text[1:], validate=True), MAX_DECODED)
        if d.unconsumed_tail:
            return None
        arr = array(text[0])
        arr.frombytes(raw[: len(raw) - len(raw) % arr.itemsize])
    except (binascii.Error, zlib.error, ValueError):
        return None
    return list(accumulate(arr))


def at_rate(indices: list[int], rate: int, to: int) -> set[int]:
    """A set kept at ``rate`` thinned to the coarser ``to`` (the sample of the coarsest rank)."""
    if to <= rate:
        return set(indices)
    limit = 1 << (HBITS - to)
    return {i for i in indices if index_hash(i) < limit}


def compare(sets: dict[int, set[int]]) -> tuple[int, int, int, list[int]]:
    """(indices held by several sets, extra copies beyond one, size of the union, a few shared
    indices) over the given sets."""
    count: dict[int, int] = {}
    for s in sets.values():
        for i in s:
            count[i] = count.get(i, 0) + 1
    shared = sorted(i for i, c in count.items() if c > 1)
    extra = sum(c - 1 for c in count.values())
    return len(shared), extra, len(count), shared[:5]


#: Calls that put a list in a random order (the method or function name).
_SHUFFLES = frozenset({"shuffle", "permutation", "randperm", "sample", "permuted"})
_MAX_SOURCE = 2 << 20


def order_line(path, line: int) -> tuple[int, str] | None:
    """The shuffle that built the order a line shards: in the function holding ``line`` of the
    user's file, the last call before it to a shuffle (``random.shuffle(files)``,
    ``np.random.permutation``, ``torch.randperm``...) whose argument or assigned name the line
    uses. (line, source text), or None (file gone, unparsable, no such call)."""
    import ast

    try:
        with open(str(path), encoding="utf-8") as f:
            text = f.read(_MAX_SOURCE + 1)
        if len(text) > _MAX_SOURCE:
            return None
        tree = ast.parse(text)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    scope: ast.AST = tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.lineno <= line <= (node.end_lineno or node.lineno):
            if scope is tree or node.lineno >= getattr(scope, "lineno", 0):
                scope = node  # the innermost function holding the line
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and getattr(n, "lineno", 0) == line}
    best = None
    for node in ast.walk(scope):
        if not isinstance(node, ast.Call) or not (node.lineno < line):
            continue
        fn = node.func
        name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
        if name not in _SHUFFLES:
            continue
        names = {n.id for a in node.args for n in ast.walk(a) if isinstance(n, ast.Name)}
        parent = next((s for s in ast.walk(scope) if isinstance(s, (ast.Assign, ast.AnnAssign))
                       and s.lineno == node.lineno), None)
        if parent is not None:
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        if names & used and (best is None or node.lineno > best):
            best = node.lineno
    if best is None:
        return None
    return best, text.splitlines()[best - 1].strip()
