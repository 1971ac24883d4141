"""How each rank ended, and which endings are root causes rather than collateral damage.

Shared by rank-failed (which reports root causes), divergent-collectives and uneven-inputs
(which leave a divergence to rank-failed when the short rank is a root cause), and
collective-misuse. Computed once per report and cached on the context; linear in ranks.

A rank's ending is one of: ``normal``, ``exception`` (with its text and line), ``hang-kill``
(ended by ddpdoctor's watchdog), ``killed`` (no exit record: SIGKILL, the OOM killer,
``os._exit``, or the launcher's SIGTERM). The classification of a failure as root cause or
collateral only compares ranks' endings with each other:

* an exception raised by the communication backend because a peer went away or did not come
  ("Connection closed by peer", "Timed out ...") is collateral;
* any other exception is a root cause (a ``KeyboardInterrupt`` is neither: it was asked for);
* a killed rank is collateral when something else explains why the job was ended (a root-cause
  exception elsewhere, a hang the watchdog diagnosed, the others timing out together), or when
  it wrote a SIGTERM stack dump while another killed rank did not (it was terminated by the
  launcher after that one died); otherwise it is a root cause.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ...trace.files import stacks_path
from ...trace.records import InFlight
from .base import Context
from .base import fmt as base_fmt

#: A peer process disappeared while this rank was communicating with it.
PEER_GONE = re.compile(
    r"closed by peer|reset by peer|broken pipe|connection refused|remote worker|"
    r"connection closed|peer .*(exited|closed|crashed)|failed to pass monitoredBarrier|"
    r"ncclRemoteError|communicator was aborted|NCCL communicator.*abort",
    re.IGNORECASE)
#: A peer did not arrive in time.
TIMED_OUT = re.compile(r"timed out|timeout|deadline exceeded|watchdog caught collective", re.IGNORECASE)
#: Other errors raised by the communication backend itself.
BACKEND = re.compile(r"DistBackendError|DistNetworkError|gloo/transport|ProcessGroupGloo|"
                     r"ProcessGroupNCCL|NCCL error|c10d/|TCPStore", re.IGNORECASE)
#: A collective used outside the lifetime of its process group (collective-misuse's domain).
MISUSE = re.compile(
    r"default process group has not been initialized|process group has (already )?been destroyed|"
    r"invalid process group|the given group does not exist|group .* (is not|was not) registered|"
    r"has not been initialized, please make sure to call init_process_group",
    re.IGNORECASE)


#: Exception types the backends raise (a user's own TimeoutError or ConnectionError is not one).
_BACKEND_TYPES = frozenset({"RuntimeError", "DistBackendError", "DistNetworkError", "DistError",
                            "DistStoreError"})


def fmt(ranks, parts: int = 8) -> str:
    """"rank 3" / "ranks 0-6" for a message; a scattered set of hundreds of ranks is cut short
    ("73 ranks: 3,10,17,...") since the finding's ``ranks`` list has them all."""
    rs = sorted(set(ranks))
    text = base_fmt(rs)
    pieces = text.split(" ", 1)[1].split(",") if " " in text else []
    if len(pieces) <= parts:
        return text
    return f"{len(rs)} ranks ({','.join(pieces[:parts])},...)"


def comm_kind(text: str) -> str:
    """"peer", "timeout", "backend" for an error raised by the backend, "" otherwise."""
    if not text:
        return ""
    etype = text.split(":", 1)[0].strip().rsplit(".", 1)[-1]
    if etype not in _BACKEND_TYPES and not BACKEND.search(text):
        return ""
    if PEER_GONE.search(text):
        return "peer"
    if TIMED_OUT.search(text):
        return "timeout"
    if BACKEND.search(text):
        return "backend"
    return ""


_SRC_PREFIX = re.compile(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def short_error(text: str, limit: int = 110) -> str:
    """An exception text without the backend's source-file prefix and boilerplate."""
    text = _SRC_PREFIX.sub("", str(text).splitlines()[0] if text else "")
    for cut in (". This is typically", " This may indicate"):
        i = text.find(cut)
        if i > 0:
            text = text[:i]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_misuse(text: str) -> bool:
    return bool(text) and MISUSE.search(text) is not None


@dataclass
class Ending:
    rank: int
    how: str  # normal | exception | killed | hang-kill | interrupted | other
    exc: str = ""
    file: str = ""
    line: int = 0
    func: str = ""
    comm: str = ""  # for exceptions: peer | timeout | backend | "" (not from the backend)
    misuse: bool = False
    root: bool = False
    why: str = ""  # for collateral endings: what explains them
    terminated: bool = False  # killed, and it wrote a SIGTERM stack dump (the launcher ended it)
    truncated: bool = False
    inflight: list = field(default_factory=list)  # events in flight at the end (op, g, s, site)
    failed_event: dict | None = None  # the sequence/p2p event that raised, if any
    stack: list = field(default_factory=list)  # for exceptions: [file, line, func, source] frames
    t_end: float = 0.0  # absolute time (s) of the ending (last record for killed ranks)

    @property
    def failed(self) -> bool:
        return self.how in ("exception", "killed", "hang-kill", "other")


def abs_time(ctx: Context, rank: int, ts) -> float:
    rt = ctx.run.ranks[rank]
    try:
        return float(rt.header.get("wall0", 0) or 0) + float(ts or 0) / 1e6
    except (TypeError, ValueError):
        return 0.0


def in_flight(ctx: Context, rank: int) -> list[dict]:
    """Calls the rank had started and not finished when its trace ends: from its exit record
    (``inflight``) and the watchdog's ``pending`` records that no completion followed."""
    rt = ctx.run.ranks[rank]
    out: list[dict] = []
    seen = set()
    waited = rt.waited  # async waits that completed after the watchdog noted them
    ex = rt.exit_record()
    cands: list[dict] = []
    if ex is not None:
        for inf in map(InFlight.decode, ex.get("inflight") or []):
            if inf is not None:
                cands.append({"op": inf.op, "g": inf.g, "s": inf.s, "site": inf.site, "ts": inf.ts,
                              "exit": True})
    cands.extend(r for r in rt.records("pending"))
    for c in cands:
        op, g, s = str(c.get("op", "?")), str(c.get("g", "0")), int(c.get("s", 0) or 0)
        key = (op, g, s, c.get("ts"))
        if key in seen:
            continue
        seen.add(key)
        if not c.get("exit"):
            if op.endswith(".wait"):
                if (g, s) in waited:
                    continue
            elif s > 0:
                gs = rt.groups.get(g)
                if gs is not None and gs.count >= s:
                    continue  # it completed after the watchdog noted it
            elif (c.get("ts") or 0) <= rt.last_ts:
                continue
        out.append({"op": op, "g": g, "s": s, "site": c.get("site"), "ts": c.get("ts")})
    return out


def _stack_dump(path: str) -> bool:
    """Whether faulthandler wrote a stack dump next to the trace (a SIGTERM or SIGUSR2)."""
    try:
        return os.path.getsize(stacks_path(path)) > 0
    except OSError:
        return False


def endings(ctx: Context) -> dict[int, Ending]:
    """See _compute_endings; computed once per context."""
    return ctx.shared("endings:_failures", _compute_endings)


def _compute_endings(ctx: Context) -> dict[int, Ending]:
    """Every rank's ending, classified (cached on the context)."""
    out: dict[int, Ending] = {}
    hang_seen = False
    for r, rt in ctx.run.ranks.items():
        ex = rt.exit_record()
        if ex is not None and ex.get("how") != "exception":
            # A rank whose main thread raised but whose process lived on (a non-daemon thread)
            # may end later another way (the watchdog's hang-kill): the exception is what counts.
            raised = [x for x in rt.records("exit") if x.get("how") == "exception"]
            if raised:
                ex = raised[0]
        e = Ending(rank=r, how="killed", truncated=rt.truncated)
        if rt.errors:
            e.failed_event = rt.errors[-1]
        if any(h.get("role") in ("reporter", "member", "local") for h in rt.records("hang")):
            hang_seen = True
        if ex is None:
            e.terminated = _stack_dump(rt.path)
            e.t_end = abs_time(ctx, r, rt.last_ts)
        else:
            how = str(ex.get("how", "other"))
            e.t_end = abs_time(ctx, r, ex.get("ts"))
            if how == "crash":  # a fatal error in native code (faulthandler's dump): a root cause
                how = "exception"
            if how == "exception":
                e.exc = str(ex.get("exc", ""))
                e.file, e.func = str(ex.get("file", "?")), str(ex.get("func", ""))
                e.stack = [f for f in ex.get("stack") or [] if isinstance(f, list)]
                try:
                    e.line = int(ex.get("line", 0) or 0)
                except (TypeError, ValueError):
                    e.line = 0
                if e.exc.startswith("KeyboardInterrupt"):
                    how = "interrupted"
                e.comm = comm_kind(e.exc)
                e.misuse = is_misuse(e.exc)
            elif how == "hang-kill":
                hang_seen = True
            elif how not in ("normal",):
                how = "other" if how != "signal" else "killed"
            e.how = how
        e.inflight = in_flight(ctx, r)
        if e.comm and not BACKEND.search(e.exc) and not e.inflight and not (
                e.failed_event and str(e.failed_event.get("err", ""))[:80] == e.exc[:80]):
            e.comm = ""  # a generic RuntimeError raised outside any collective is the user's own
        out[r] = e
    _classify(out, hang_seen)
    return out


def _classify(ends: dict[int, Ending], hang_seen: bool) -> None:
    raised = [e for e in ends.values() if e.how == "exception" and (not e.comm or e.misuse)]
    for e in raised:
        e.root = True
    first = min(raised, key=lambda e: e.t_end) if raised else None
    for e in ends.values():
        if e.how == "exception" and e.comm and not e.misuse:
            e.why = ("the peer it was communicating with went away" if e.comm == "peer" else
                     "the backend gave up waiting for a peer" if e.comm == "timeout" else
                     "the communication backend failed")
        elif e.how == "hang-kill":
            e.why = "ddpdoctor ended it after diagnosing a hang"
    killed = [e for e in ends.values() if e.how == "killed"]
    if not killed:
        return
    others_failed = [e for e in ends.values() if e.how == "exception" and e.comm]
    if first is not None:
        for e in killed:
            e.why = f"ended after rank {first.rank} failed"
        return
    if hang_seen:
        for e in killed:
            e.why = "ended after the hang the watchdog diagnosed"
        return
    if others_failed and all(e.comm == "timeout" for e in others_failed):
        for e in killed:
            e.why = "ended after the other ranks timed out (a hang, not a crash)"
        return
    silent = [e for e in killed if not e.terminated]
    if len(silent) < len(killed) and silent:
        for e in killed:
            if e.terminated:
                e.why = "terminated (SIGTERM) after another rank died"
            else:
                e.root = True
        return
    if len(killed) == len(ends):
        for e in killed:
            e.why = "every rank was ended from outside (scheduler limit, launcher, Ctrl-C)"
        return
    for e in killed:
        e.root = True


def root_causes(ctx: Context) -> set[int]:
    return {r for r, e in endings(ctx).items() if e.root}
