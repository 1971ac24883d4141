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
