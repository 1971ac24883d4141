"""The optional C reader of Flight Recorder pickles (``_frpickle.c``): the plain-data subset of
pickle's opcodes, read into the rows the converter needs, with no object made for the fields it
never reads. Where the extension is not built, ``DDPDOCTOR_NATIVE=0`` is set, or the file is
anything but that subset (a global, an opcode outside it, a malformed pickle, an entry without
``pg_id`` or an int ``record_id``...), :func:`read` gives None and the caller reads the file with
frdump's restricted unpickler, which alone decides whether a pickle is refused. Both paths give
the same converted trace (tests/unit/test_frnative.py)."""

from __future__ import annotations

import os

from . import native

#: Larger files go to the Python path: the C reader's tables take up to ~40 bytes per byte of a
#: crafted file (one node per 1-byte opcode), the unpickler's objects less; a 20,000-entry dump
#: with stacks is ~3 MB, so real dumps stay far below.
MAX_BYTES = 64 << 20
#: The entry fields the C reader looks up, in the order it expects: the 13 the converter reads
#: with one itemgetter (frconvert._NAMES; the first 9 make an entry's kind), then the frames and
#: three read one by one.
FIELDS = ("profiling_name", "process_group", "pg_id", "input_sizes", "input_dtypes", "output_sizes",
          "output_dtypes", "state", "retired", "time_created_ns", "time_discovered_completed_ns",
          "collective_seq_id", "is_p2p", "frames", "duration_ms", "p2p_seq_id", "record_id")
#: An entry without one of these is left to the Python path: ``pg_id`` has a default of its own
#: there ("0", not None), and a missing or non-int ``record_id`` changes how entries are sorted.
REQUIRED = object()
#: Values of missing fields: those of frconvert._fields_slow and of ``dict.get``.
DEFAULTS = ("?", None, REQUIRED, None, None, None, None, "?", None, None, None, None, None, None, None, None,
            REQUIRED)
#: Where each field lands in a row (its pair index, then these).
ROW = ("time_created_ns", "time_discovered_completed_ns", "collective_seq_id", "is_p2p", "duration_ms",
       "p2p_seq_id", "record_id")


def _module():
    return native.load("_frpickle")


def read(path: str) -> tuple | None:
    """``(head, rows, kinds, stacks, pairs, ordered)`` for a pickle in the plain subset, else None.

    ``head``: the dump's dict without ``entries``; ``rows``: one tuple an entry that is a dict, in
    the file's order: (pair index, then the fields of :data:`ROW`, missing ones None);
    ``pairs[p]``: (kind index, stack index) of pair p; ``kinds[i]``: the first 9 fields of the first
    entry of kind i (missing: :data:`DEFAULTS`); ``stacks[j]``: the frames of the first entry of
    stack j; ``ordered``: record ids non-decreasing."""
    mod = _module()
    if mod is None:
        return None
    try:
        if os.path.getsize(path) > MAX_BYTES:
            return None
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return mod.rows(data, FIELDS, DEFAULTS, REQUIRED)


def available() -> bool:
    """Whether the C reader is built and on."""
    return _module() is not None
