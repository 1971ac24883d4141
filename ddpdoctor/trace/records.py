"""Named record types and encoders of the trace contract (docs/trace-format.md).

The hot path (``rank.patches.dist``) formats its sequence events by hand for speed; every other
record is built here, so the writer and the readers agree on one spelling of each field.
"""

from __future__ import annotations

from typing import Any, NamedTuple

#: A record of type ``t`` is written under this key.
TYPE = "t"


class InFlight(NamedTuple):
    """A call some thread of a rank is inside right now (the recorder's ``inflight`` table), and
    the same call as written in ``exit`` / ``hang`` records: a JSON list in this field order."""

    op: str
    g: str
    s: int
    site: Any
    ts: int

    @classmethod
    def decode(cls, item: Any) -> InFlight | None:
        """From a JSON list of a trace record; None for a malformed entry."""
        if not isinstance(item, (list, tuple)) or len(item) < 5:
            return None
        return cls(*item[:5])

    def encode(self) -> list:
        return list(self)


def inflight_list(table: dict) -> list[list]:
    """The ``inflight`` field of an exit or hang record, from the recorder's table (a snapshot:
    other threads may change it meanwhile)."""
    return [list(v) for v in list(table.values())]


def header(*, run: str | None, rank: int, world: int, host: str, pid: int, attempt: int, **extra: Any) -> dict:
    """The first record of every rank file (schema version, who wrote it)."""
    from .files import SCHEMA_VERSION

    return {TYPE: "header", "schema": SCHEMA_VERSION, "run": run, "rank": rank, "world": world, "host": host,
            "pid": pid, "attempt": attempt, **extra}


def site(sid: int, file: str, line: int, func: str, src: str = "", stack: list | None = None,
         conds: list | None = None, via: str | None = None) -> dict:
    """An interned call site (events refer to it by ``id``)."""
    rec: dict = {TYPE: "site", "id": sid, "file": file, "line": line, "func": func, "src": src,
                 "stack": stack if stack is not None else [[file, line, func, src]]}
    if conds is not None:
        rec["conds"] = conds
    if via:
        rec["via"] = via
    return rec


def exit_record(how: str, **fields: Any) -> dict:
    """How a rank ended: ``normal``, ``exception`` (with ``exc``, ``file``, ``line``...),
    ``hang-kill``... (fields in the caller's order, ``ts`` among them)."""
    return {TYPE: "exit", "how": how, **fields}
