"""Per-process recording state: the trace file, call-site table, per-group sequence numbers and
what each thread is waiting in right now (read by the hang watchdog).

A process becomes a *rank* (gets a trace file) when it initialises a process group; until then
events are buffered in memory, so processes that never do (the torchrun agent, DataLoader
workers, helpers) leave no file behind.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from ..trace import records
from ..trace.files import TraceWriter, dumps, hostname, trace_file_name
from ..trace.mappedtrace import MappedTraceWriter
from ..trace.records import InFlight
from . import native
from . import settings as settings_mod
from .callsite import SiteTable

_recorder: Recorder | None = None
_lock = threading.Lock()


class _ThreadState(threading.local):
    """Per-thread state; class attributes are the defaults, so the hot path reads
    ``rec.local.depth`` without ``getattr(..., default)``.

    ``depth`` > 0 while a thread is inside a patched call that records its own event (DDP's
    constructor and forward, init_process_group...): collectives it issues are not events.
    (A process-wide count of such threads, to skip this ~1k-instruction read, cost more than
    it saved: a Python ``__setattr__`` on every DDP forward, measured with callgrind.)"""

    depth = 0


def _c_depth() -> None:
    """``depth`` in C where the extension is built and on (rank/_fastcall.c: its read by the C
    repeat-call path costs ~10 instructions instead of ~560); Python code uses it unchanged."""
    mod = native.load("_fastcall")
    if mod is not None:
        _ThreadState.depth = mod.Depth()


_c_depth()


def get() -> Recorder | None:
    return _recorder


def install(settings: settings_mod.Settings | None = None) -> Recorder:
    """Create the process-wide recorder once (idempotent)."""
    global _recorder
    with _lock:
        if _recorder is None:
            _recorder = Recorder(settings or settings_mod.from_env())
        return _recorder


class Recorder:
    def __init__(self, settings: settings_mod.Settings) -> None:
        self.settings = settings
        self.enabled = True
        self.writer: TraceWriter | None = None
        self.slot = None  # inflightfile.InflightSlot once this process is a rank
        self.rank: int | None = None
        self.world: int | None = None
        self._pending: list[str] = []  # records made before the process group existed
        self.t0_ns = time.perf_counter_ns()
        self.wall0 = time.time()
        self.sites = SiteTable(self.emit)
        self.seq: dict[str, int] = {}  # group name -> number of sequence events issued
        self.p2p: dict[str, int] = {}  # channel "src>dst@group" -> number of messages
        self.group_names: dict[int, str] = {}  # id(ProcessGroup) -> name
        self.group_ranks: dict[str, list[int]] = {}
        self.inflight: dict[object, InFlight] = {}  # thread id (or a DDP key) -> the call it is inside
        self.local = _ThreadState()  # .depth: nesting of patched calls on this thread
        # id(Work) -> (op, group, seq, site, p2p wait-record tag, weakref to the Work)
        self.async_pending: dict[int, tuple] = {}
        self.ddp_refs: list = []  # weak references to DDP modules (see patch_ddp)
        self.events = 0
        self.last_event: tuple | None = None  # (op, group, seq, site, end_us)
        self.last_failed: tuple | None = None  # (op, group, seq, start_us) of the last call that raised
        self._error_logged = False
        self.watchdog = None
        self.exit_recorded = False  # an exit record was written (exit hooks, watchdog, check())
        self.exit_info: dict | None = None  # how this rank ended, for the watchdog's diagnosis
        self.stacks_file = None  # kept open for faulthandler's stack dumps
        self.installed: set[str] = set()  # process-wide hooks installed once ("exit", "files")
        # DDP parameter/gradient memory ranges (patches.ddp.overlap), rebuilt when marked dirty
        self._ddp_ptrs: dict = {"dirty": True, "map": {}}
        self.output_fault: dict | None = None  # set once the trace output failed (outfault)

    # -- time ---------------------------------------------------------------------------------
    def now_us(self) -> int:
        return (time.perf_counter_ns() - self.t0_ns) // 1000

    # -- output -------------------------------------------------------------------------------
    def emit(self, record: dict) -> None:
        self.emit_line(dumps(record))

    def emit_line(self, line: str) -> None:
        w = self.writer
        if w is not None:
            try:
                if w.closed:
                    return
                try:
                    w.append((line + "\n").encode("utf-8", "backslashreplace"))
                except AttributeError:  # the write-per-record writer
                    w.write_line(line)
            except OSError as exc:
                self.internal_error(exc)
        elif self.output_fault is not None:
            if line.startswith('{"t":"exit"'):
                from ..trace import outfault

                outfault.keep_exit(self, line)
        elif self.enabled and len(self._pending) < 10000:
            self._pending.append(line)

    def emit_bytes(self, data: bytes) -> None:
        """An encoded record with its newline (the hot path's fallback, see patch_dist)."""
        w = self.writer
        if w is not None:
            try:
                append = getattr(w, "append", None)
                if append is not None:
                    append(data)
                else:
                    w.write_line(data[:-1].decode("utf-8", "replace"))
            except OSError as exc:
                self.internal_error(exc)
        elif self.enabled and len(self._pending) < 10000:
            self._pending.append(data[:-1].decode("utf-8", "replace"))

    def open_trace(self, rank: int, world: int, backend: str, timeout_s: float | None,
                   local_rank: int | None = None) -> None:
        """Called once the default process group exists: this process is now a rank."""
        if self.writer is not None or not self.settings.out or not self.enabled:
            return
        self.rank, self.world = rank, world
        out = self.settings.out
        try:
            os.makedirs(out, mode=0o755, exist_ok=True)
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
            host = hostname()
            path = os.path.join(out, trace_file_name(rank, host, os.getpid(), attempt))
            try:
                # Records are stores into mapped memory (see mappedtrace); a file system that
                # cannot reserve or map gets the write-per-record writer.
                self.writer = MappedTraceWriter(path)
            except (OSError, ValueError):
                self.writer = TraceWriter(path)
        except OSError as exc:
            from ..trace import outfault

            outfault.failed(self, exc, "create")
            return
        import torch

        header = records.header(
            run=self.settings.run_id, rank=rank, world=world, host=host, pid=os.getpid(), attempt=attempt,
            local_rank=local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", rank)),
            torch=torch.__version__, backend=backend, argv=list(sys.argv), python=sys.version.split()[0],
            wall0=self.wall0, pg_timeout_s=timeout_s, hang_timeout_s=self.settings.hang_timeout,
            tool="ddpdoctor")
        try:
            from ..trace.inflight import SUFFIX, InflightSlot

            # First, so that its space is reserved before the disk can fill up.
            self.slot = InflightSlot(path[: -len(".jsonl")] + SUFFIX)
        except (OSError, ValueError):
            self.slot = None
        self.emit(header)
        if self.writer is None:  # the write failed (outfault): nothing more to do here
            return
        # Call sites interned before the file existed (events refer to them by id), then the
        # records made before the process group existed.
        for sid in sorted(self.sites.records):
            self.writer.write(self.sites.records[sid])
        for line in self._pending:
            if not line.startswith('{"t":"site"'):
                self.writer.write_line(line)
        self._pending.clear()

    def discard_pending(self) -> None:
        """Forget the records made before the trace file existed."""
        self._pending.clear()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    # -- groups -------------------------------------------------------------------------------
    def group_name(self, group) -> str:
        """Stable name of a process group, the same on every member rank."""
        if group is None:
            return "0"
        key = id(group)
        name = self.group_names.get(key)
        if name is None:
            name = self._resolve_group(group)
        return name

    def _resolve_group(self, group) -> str:
        try:
            from torch.distributed import distributed_c10d as c10d

            if group is c10d.GroupMember.WORLD or group is c10d._get_default_group():
                name = "0"
            else:
                name = str(c10d._get_process_group_name(group))
        except Exception:
            name = str(getattr(group, "group_name", "?"))
        self.group_names[id(group)] = name
        return name

    def next_seq(self, gname: str) -> int:
        s = self.seq.get(gname, 0) + 1
        self.seq[gname] = s
        return s

    def next_p2p(self, channel: str) -> int:
        s = self.p2p.get(channel, 0) + 1
        self.p2p[channel] = s
        return s

    def position(self) -> dict[str, int]:
        """How many sequence events this rank has completed per group (a vector clock)."""
        return dict(self.seq)

    # -- errors -------------------------------------------------------------------------------
    def internal_error(self, exc: BaseException) -> None:
        """ddpdoctor must never break the traced program: log once, then get out of the way.
        A failing trace output (full disk, folder gone) is no internal error: see outfault."""
        if self.writer is not None or self.output_fault is not None:
            from ..trace import outfault

            if outfault.is_output_error(exc):
                outfault.failed(self, exc, "write")
                return
        if self.settings.debug:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        if not self._error_logged:
            self._error_logged = True
            print(f"ddpdoctor: internal error, recording continues where it can: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
