"""``ddpdoctor.check()`` and what it shares with ``spawn()`` (analysis of the traces, exit records).

Test-suite API: make a distributed test that would hang or silently diverge fail fast, with
the diagnosis.

* ``ddpdoctor.check()`` wraps a block of distributed code inside a rank. Leaving the block
  exchanges the ranks' traces through the job's c10d store (never a collective on the user's
  groups, which may be broken), runs the usual checks on every rank over the same data, and
  raises the same ``DistributedBugError`` on every rank when something is wrong. A collective
  pending longer than ``hang_timeout`` is diagnosed by the in-rank watchdog, which ends the job.
* ``ddpdoctor.spawn()`` (``testing.spawner``) runs ``fn(rank, *args)`` on N local processes.

Nothing here imports torch at module level: the pytest plugin and the parent of ``spawn`` import
this module and never need torch themselves.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
import zlib
from typing import Sequence

from ..errors import DistributedBugError, TraceError

__all__ = ["DistributedBugError", "check"]

#: Set by ``spawn`` in its children: the folder shared by the ranks of one spawn.
ENV_CHECK_DIR = "DDPDOCTOR_CHECK_DIR"
_FAIL_ON = ("error", "warning", "info", "never")
_STORE_PREFIX = "ddpdoctor/check/"
#: Op name under which a rank waiting for the others at the end of a block is shown.
_END_OP = "check_end"
#: How long a rank whose collective raised waits for the others' traces before giving up.
_ERROR_EXCHANGE_S = 10.0
#: After the exchange, how long a rank waits until every rank has read its trace from the
#: store (the store's server lives in one of the ranks; it must not go away too early).
_DONE_WAIT_S = 10.0
_PATCHES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rank", "patches").replace(
    "\\", "/")


# ------------------------------------------------------------------------------------------
# analysis shared by check() and spawn()


def _limit(fail_on: str) -> int:
    from ..analysis.findings import SEVERITY_RANK

    if fail_on not in _FAIL_ON:
        raise ValueError(f"fail_on must be one of {', '.join(_FAIL_ON)}, not {fail_on!r}")
    return -1 if fail_on == "never" else SEVERITY_RANK[fail_on]


def _analyze(folder: str, fail_on: str, select, ignore):
    """(run, findings at/above fail_on, rendered report) of the traces in folder, or None."""
    from ..analysis.engine import analyze_paths
    from ..render.text import render

    _limit(fail_on)  # a bad fail_on is the caller's ValueError
    try:
        result = analyze_paths([folder], select, ignore, fail_on=fail_on)
    except TraceError:
        return None
    failing = result.failing
    return result.run, failing, render(result.run, failing, result.notes)


def _finding_from_json(d: dict):
    from dataclasses import fields

    from ..analysis.findings import Finding, Location

    names = {f.name for f in fields(Finding)}
    kw = {k: v for k, v in d.items() if k in names}
    kw["locations"] = [Location(**loc) for loc in d.get("locations") or []]
    return Finding(**kw)


def _is_distributed_failure(exc: BaseException) -> bool:
    """An exception raised by a torch.distributed call itself (a backend error on mismatched
    collectives, a closed connection, a timeout), as opposed to one from the user's code."""
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist is not None else None
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    if last is None:
        return False
    path = last.replace("\\", "/")
    # The innermost Python frame is the call into the backend: torch.distributed's own code, or
    # one of ddpdoctor's wrappers around it (``Work.wait``...).
    return "/torch/distributed/" in path or (
        os.path.dirname(path) == _PATCHES)


def _exit_record(rec, exc: BaseException | None) -> dict:
    """How this rank left the block, as a trace ``exit`` record (see exithooks)."""
    from ..rank.patches.exit import exception_exit, normal_exit

    if exc is None:
        return normal_exit(rec, scope="check")
    return exception_exit(rec, exc, [], scope="check")


# ------------------------------------------------------------------------------------------
# check()


class _Check:
    """The context manager returned by :func:`check`."""

    def __init__(self, hang_timeout: float | None, fail_on: str, select, ignore, on_hang: str,
                 exchange_timeout: float | None) -> None:
        _limit(fail_on)  # validate now, not when leaving the block
        if on_hang not in ("kill", "report"):
            raise ValueError(f"on_hang must be 'kill' or 'report', not {on_hang!r}")
        self.hang_timeout = hang_timeout
        self.fail_on = fail_on
        self.select = list(select) if select else None
        self.ignore = list(ignore) if ignore else None
        self.on_hang = on_hang
        self.exchange_timeout = exchange_timeout
        self._active = False

    # -- enter --------------------------------------------------------------------------------
    def __enter__(self) -> _Check:
        if self._active:
            raise RuntimeError("this ddpdoctor.check() block is already active")
        from ..rank import activate
        from ..rank import recorder as recorder_mod
        from ..rank import settings as settings_mod

        activate.activate_in_process()
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ddpdoctor.check() needs the default process group: call "
                "torch.distributed.init_process_group() before entering the block (or run the whole "
                "function with ddpdoctor.spawn(), which records every rank from its "
                "init_process_group on)")
        rec = recorder_mod.get()
        if rec is None:
            raise RuntimeError("ddpdoctor.check(): instrumentation could not be enabled in this "
                               "process (see the message printed when torch was imported)")
        from torch.distributed import distributed_c10d as c10d

        # Held for the whole block: it keeps the store usable for the exchange even if the
        # block destroys the process group.
        self._store = c10d._get_default_store()
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        # A block number that every rank agrees on, without a collective: each rank adds one.
        n = (self._store.add(_STORE_PREFIX + "count", 1) - 1) // self._world
        self._prefix = f"{_STORE_PREFIX}{n}/"
        self._private_out: str | None = None
        self._wd_replaced = False
        hang = self.hang_timeout
        if rec.writer is not None and not rec.writer.closed and rec.settings.out:
            # Already recording (ddpdoctor trace / spawn): the block is part of that trace.
            self._nested = True
            self._saved_settings = rec.settings
            if hang is None:
                hang = rec.settings.hang_timeout
            if hang != rec.settings.hang_timeout or self.on_hang != rec.settings.on_hang:
                self._swap_watchdog(rec, hang, self.on_hang)
        else:
            self._nested = False
            if hang is None:
                hang = settings_mod.DEFAULT_HANG_TIMEOUT
            shared = os.environ.get(ENV_CHECK_DIR)
            if shared:
                out = os.path.join(shared, f"check-{n}")
                os.makedirs(out, exist_ok=True)
            else:
                out = self._private_out = tempfile.mkdtemp(prefix=f"ddpdoctor-check-r{self._rank}-")
            base = (os.environ.get(settings_mod.ENV_RUN_ID) or os.environ.get("TORCHELASTIC_RUN_ID")
                    or "check")
            # Unique per block: the watchdog keys its store entries (kill flag...) by run id.
            from ..rank import session

            path = session.start(rec, out, hang, self.on_hang, f"{base}-check{n}")
            if path is None:
                raise RuntimeError("ddpdoctor.check(): could not open a trace file in " + out)
        self.out = rec.settings.out  # where the watchdog writes its diagnosis
        self._stop_echo = None
        plugin = sys.modules.get("ddpdoctor.pytest_plugin")
        if plugin is not None and self.out:
            try:
                self._stop_echo = plugin.echo_hang_diagnosis(self.out)
            except Exception as e:
                rec.internal_error(e)
        self._active = True
        return self

    def _swap_watchdog(self, rec, hang: float, on_hang: str) -> None:
        import dataclasses

        from ..rank import watchdog

        if rec.watchdog is not None:
            rec.watchdog.stop()
            rec.watchdog = None
        rec.settings = dataclasses.replace(rec.settings, hang_timeout=float(hang), on_hang=on_hang)
        watchdog.start(rec)
        self._wd_replaced = True

    # -- exit ---------------------------------------------------------------------------------
    def __exit__(self, etype, exc, tb) -> bool:
        if not self._active:
            return False
        self._active = False
        from ..rank import recorder as recorder_mod

        rec = recorder_mod.get()
        if exc is not None and (isinstance(exc, DistributedBugError)
                                or not _is_distributed_failure(exc)):
            status = "exception"
        elif exc is not None:
            status = "collective-error"
        else:
            status = "ok"
        result: DistributedBugError | None = None
        try:
            if status == "exception":
                # Let the others see this rank's end at once; nothing here may mask the
                # block's own exception.
                try:
                    self._publish(status, exc, self._snapshot(rec, exc))
                except Exception as e:
                    if rec is not None:
                        rec.internal_error(e)
            else:
                self._publish(status, exc, self._snapshot(rec, exc))
                # The watchdog keeps running while we wait: a rank stuck in a collective is
                # diagnosed, and the kill flag ends this rank too.
                wait = self.exchange_timeout
                if wait is None:
                    wait = max(60.0, 3 * float(rec.settings.hang_timeout or 0))
                if status == "collective-error":
                    wait = min(wait, _ERROR_EXCHANGE_S)
                result = self._exchange_and_analyze(rec, status, exc, wait)
        except Exception as e:
            if exc is None:
                raise
            if rec is not None:
                rec.internal_error(e)  # the backend's error stays the one raised
        finally:
            self._end(rec)
        if result is not None:
            if exc is not None:
                raise result from exc
            raise result
        return False  # an exception from the block propagates unchanged

    def _snapshot(self, rec, exc: BaseException | None) -> bytes:
        """This rank's trace as it stands, ending with how the block ended."""
        record = _exit_record(rec, exc)
        from ..trace.files import dumps

        path = rec.writer.path if rec.writer is not None else None
        if not self._nested:
            rec.emit(record)  # the kept trace file says how the block ended, too
            extra = b""
        else:
            extra = (dumps(record) + "\n").encode()
        data = b""
        if path is not None:
            with open(path, "rb") as f:
                data = f.read()
        if data and not data.endswith(b"\n"):
            data = data[: data.rfind(b"\n") + 1]
        self._name = os.path.basename(path) if path else f"rank{self._rank:05d}-check.jsonl"
        return data + extra

    def _publish(self, status: str, exc: BaseException | None, payload: bytes) -> None:
        meta = {"name": self._name, "status": status,
                "exc": None if exc is None else f"{type(exc).__name__}: {exc}"[:2000]}
        value = json.dumps(meta).encode() + b"\n" + zlib.compress(payload, 1)
        try:
            self._store.set(f"{self._prefix}r{self._rank}", value)
        except Exception as e:  # the store is gone: nothing to compare with
            if status == "ok":
                raise DistributedBugError(
                    f"ddpdoctor.check(): could not publish rank {self._rank}'s trace to the job's "
                    f"store ({type(e).__name__}: {e}): another rank probably ended") from e

    def _exchange_and_analyze(self, rec, status: str, exc, wait: float) -> DistributedBugError | None:
        keys = [f"{self._prefix}r{r}" for r in range(self._world)]
        deadline = time.monotonic() + wait
        complete = False
        # Leaving the block waits for every rank, like a barrier: shown to the watchdog as a
        # call in flight at the user's ``with`` line, so that a rank still stuck in a collective
        # is diagnosed against the ranks waiting here (not as "running elsewhere").
        tid = threading.get_ident()
        try:
            rec.inflight[tid] = (_END_OP, "0", rec.seq.get("0", 0) + 1, rec.sites.current(1),
                                 rec.now_us())
        except Exception as e:
            rec.internal_error(e)
        try:
            while True:
                if self._store.check(keys):
                    complete = True
                    break
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
            have = keys if complete else [k for k in keys if self._store.check([k])]
            values = {int(k.rsplit("r", 1)[1]): bytes(self._store.get(k)) for k in have}
        except Exception as e:  # a rank hosting the store ended
            if status == "collective-error":
                return None  # the backend's own error says as much
            return DistributedBugError(
                f"ddpdoctor.check(): the ranks' traces could not be exchanged through the job's "
                f"store ({type(e).__name__}: {e}): a rank probably ended inside the block")
        finally:
            rec.inflight.pop(tid, None)
        # Under spawn() it goes with the spawn's folder (kept on failure, removed on success).
        shared = os.environ.get(ENV_CHECK_DIR)
        tmp = tempfile.mkdtemp(prefix=f"ddpdoctor-check-r{self._rank}-",
                               dir=shared if shared and os.path.isdir(shared) else None)
        peers: dict[int, dict] = {}
        blobs: dict[int, bytes] = {}
        for r, value in sorted(values.items()):
            head, _, body = value.partition(b"\n")
            peers[r] = json.loads(head)
            blobs[r] = body
        if complete:
            # A rank whose own code raised does not wait for the others' traces.
            self._done([r for r, m in peers.items() if m.get("status") != "exception"])
        for r, body in blobs.items():
            meta = peers[r]
            data = zlib.decompress(body)
            # One run id for all files: the folder holds exactly this block's traces.
            first, _, rest = data.partition(b"\n")
            try:
                header = json.loads(first)
                header["run"] = "check"
                data = json.dumps(header, separators=(",", ":")).encode() + b"\n" + rest
            except ValueError:
                pass
            name = os.path.basename(str(meta.get("name") or f"rank{r:05d}.jsonl"))
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        analysis = _analyze(tmp, self.fail_on, self.select, self.ignore)
        missing = [r for r in range(self._world) if r not in values]
        failed = {r: m for r, m in peers.items() if m.get("status") != "ok" and r != self._rank}
        from ..trace.ranges import fmt_ranks

        report = analysis[2] if analysis is not None else ""
        findings = analysis[1] if analysis is not None else []
        if findings:
            msg = report
            if status == "collective-error":
                msg += f"\n\nrank {self._rank}'s collective raised: {type(exc).__name__}: {exc}"
            return DistributedBugError(msg, findings, trace_dir=tmp)
        if status == "collective-error":
            shutil.rmtree(tmp, ignore_errors=True)
            return None  # nothing to explain it: the backend's own error is the best message
        if missing:
            return DistributedBugError(
                f"ddpdoctor.check(): rank(s) {fmt_ranks(missing)} did not reach the end of the "
                f"block within {wait:g} s (rank {self._rank} waited for them there)\n\n{report}",
                findings, trace_dir=tmp)
        if failed:
            lines = [f"rank {r} raised inside the block: {m.get('exc')}" for r, m in failed.items()]
            return DistributedBugError("ddpdoctor.check(): " + "\n".join(lines) + "\n\n" + report,
                                       findings, trace_dir=tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        return None

    def _done(self, ranks: list[int]) -> None:
        """Wait (bounded) until every rank has read the traces: the store's server lives in
        one of the ranks, which may leave the block first and end its process."""
        try:
            self._store.set(f"{self._prefix}done{self._rank}", b"1")
            done = [f"{self._prefix}done{r}" for r in ranks]
            deadline = time.monotonic() + _DONE_WAIT_S
            while not self._store.check(done) and time.monotonic() < deadline:
                time.sleep(0.02)
        except Exception:
            pass

    def _end(self, rec) -> None:
        if self._stop_echo is not None:
            self._stop_echo()
        try:
            if rec is None:
                return
            if self._nested:
                if self._wd_replaced:
                    from ..rank import watchdog

                    if rec.watchdog is not None:
                        rec.watchdog.stop()
                        rec.watchdog = None
                    rec.settings = self._saved_settings
                    watchdog.start(rec)
                else:
                    rec.settings = self._saved_settings
            else:
                from ..rank import session

                session.end(rec)
                if self._private_out is not None:
                    shutil.rmtree(self._private_out, ignore_errors=True)
        finally:
            self._store = None


def check(hang_timeout: float | None = None, fail_on: str = "error", select: Sequence[str] | None = None,
          ignore: Sequence[str] | None = None, *, on_hang: str = "kill",
          exchange_timeout: float | None = None) -> _Check:
    """Check a block of distributed code; use as ``with ddpdoctor.check(hang_timeout=10): ...``
    on every rank, after ``init_process_group``.

    Leaving the block compares the ranks' traces (through the job's c10d store, not a
    collective) and raises the same :class:`DistributedBugError` on every rank if a check finds
    something at or above ``fail_on`` (``error``, ``warning``, ``info``, ``never``). ``select`` /
    ``ignore`` choose checks by id or category. A collective pending longer than
    ``hang_timeout`` seconds (default: the surrounding trace's setting, else 60; 0 disables) is
    diagnosed by the watchdog; with ``on_hang="kill"`` the ranks then end themselves (exit 124)
    so that the test fails instead of hanging.

    An exception raised by the block's own code propagates unchanged. When a collective itself
    raises (a backend error on mismatched collectives), the error is replaced by a
    ``DistributedBugError`` chained to it if a check explains it. ``exchange_timeout`` bounds the
    wait for the other ranks at the end of the block (default ``max(60, 3 * hang_timeout)``).
    """
    return _Check(hang_timeout, fail_on, select, ignore, on_hang, exchange_timeout)
