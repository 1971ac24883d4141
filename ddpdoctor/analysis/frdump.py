"""Reading PyTorch Flight Recorder (FR) dumps: recognised by content, never executed.

torch writes one dump per rank: a pickle from ``torch._C._distributed_c10d._dump_fr_trace()``
(also what NCCL's watchdog writes to ``<TORCH_FR_DUMP_TEMP_FILE><rank>`` on a timeout) or JSON
from ``_dump_fr_trace_json()`` / the debug server. Both are plain data: a dict with ``version``,
``pg_config``, ``pg_status``, ``entries`` (dicts, lists, strings, numbers, tuples).

A pickle can name any Python callable and have it called while it is read. The unpickler here
refuses every global (``find_class`` raises), which is the only way a pickle reaches a callable
(GLOBAL, STACK_GLOBAL, INST, OBJ and the copyreg extension codes all go through it; persistent
ids are refused by default): a hostile file stops with :class:`DumpRefused` before anything of
it runs. ddpdoctor's own traces stay JSON; pickle is read here and nowhere else.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import re
from functools import partial

from .load import TraceError

#: Keys that make a JSON object (or an unpickled dict) a Flight Recorder dump.
_FR_KEYS = ("entries", "pg_config", "pg_status", "comm_lib_version")
_JSON_HINTS = tuple(f'"{k}"'.encode() for k in _FR_KEYS)
#: Bytes read to recognise a file.
_SNIFF = 4096
#: Files larger than this are not read as dumps (a 20,000-entry dump with stacks is ~3 MB).
MAX_BYTES = 2 << 30
#: Extensions stripped before reading the rank from the end of a file name.
_EXTS = (".json", ".pkl", ".pickle", ".pt", ".bin", ".dump", ".fr")
_TRAILING_INT = re.compile(r"(\d+)$")


class DumpRefused(TraceError):
    """A pickle that asks to import or call something: refused, never executed."""


class _Refused(pickle.UnpicklingError):
    pass


class _PlainUnpickler(pickle.Unpickler):
    """Builds only dicts, lists, tuples, strings, numbers, booleans and None."""

    def find_class(self, module, name):  # noqa: D401 - pickle's API
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _Refused(f"persistent id {str(pid)[:40]!r}")


#: ``encode(value)``: plain data read from a dump as bytes that tell it apart exactly (equal bytes:
#: equal values of equal types; 1, True and 1.0 differ, so do a list and a tuple, bytes and a
#: bytearray). A cache key for values that are not hashable (lists); pickle *writing*, never read.
encode = partial(pickle.dumps, protocol=4)


class KeyPickler:
    """:data:`encode` for many values, ~30% cheaper a value: one pickler, reused, in fast mode.

    ``dump(value)`` then ``parts.pop()`` gives the value's bytes (when ``parts`` is still not
    empty, a large value was written in several parts: join them all). Fast mode writes no memo,
    so a value shared twice inside a key is written twice, as a copy would be: equal bytes still
    mean equal values of equal types, and the converter reads values, never identities. A cyclic
    value raises ValueError (use :data:`encode`); an absurdly nested one RecursionError."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.write = self.parts.append  # the pickler's file: each dump writes its bytes here
        self.pickler = pickle.Pickler(self, protocol=4)
        self.pickler.fast = True


def sniff(path: str) -> str | None:
    """``"pickle"`` or ``"json"`` when the file looks like an FR dump, else None. Cheap: reads
    the first 4 KiB. A pickle is only recognised here; whether it is a dump is known once it has
    been read (safely) by :func:`read`."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF)
    except OSError:
        return None
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    if head.lstrip()[:1] == b"{" and any(h in head for h in _JSON_HINTS):
        return "json"
    return None


def read(path: str, kind: str) -> dict | None:
    """The dump as a dict, None when the file is not an FR dump (another pickle or JSON object).

    Raises DumpRefused for a pickle that names a global, TraceError-free otherwise: an unreadable
    or malformed file gives None and the caller notes it."""
    try:
        if os.path.getsize(path) > MAX_BYTES:
            return None
        f = open(path, "rb")  # buffered: the C unpickler prefetches through peek(), 3x faster than BytesIO
    except OSError:
        return None
    gc_was = gc.isenabled()
    gc.disable()  # a dump is millions of small containers and no cycles: collections only cost time
    try:
        with f:
            if kind == "pickle":
                obj = _PlainUnpickler(f).load()
            else:
                obj = json.load(f)
    except _Refused as exc:
        raise DumpRefused(
            f"refusing {path}: the pickle asks for {exc} — a Flight Recorder dump holds only "
            "plain data, so this file is not one and is never executed (move it out of the folder, "
            "or name the dump files themselves)") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, OSError,
            AttributeError, OverflowError, MemoryError, RecursionError, UnicodeDecodeError):
        return None
    finally:
        if gc_was:
            gc.enable()
    if not isinstance(obj, dict) or not isinstance(obj.get("entries", []), list) \
            or not any(k in obj for k in _FR_KEYS[:3]):
        return None
    return obj


def rank_of(path: str, dump: dict) -> int | None:
    """The dump's rank: a ``rank`` field when the dump has one, else the number ending the
    file name (torch names dumps ``<prefix><rank>``), an extension such as ``.json`` aside."""
    r = dump.get("rank")
    if isinstance(r, int) and not isinstance(r, bool) and r >= 0:
        return r
    name = os.path.basename(path)
    for ext in _EXTS:
        if name.lower().endswith(ext):
            name = name[: -len(ext)]
            break
    m = _TRAILING_INT.search(name)
    return int(m.group(1)) if m else None
