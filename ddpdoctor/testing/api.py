"""Test-suite API: make a distributed test that would hang or silently diverge fail fast, with
the diagnosis.

* ``ddpdoctor.check()`` wraps a block of distributed code inside a rank. Leaving the block
  exchanges the ranks' traces through the job's c10d store (never a collective on the user's
  groups, which may be broken), runs the usual checks on every rank over the same data, and
  raises the same ``DistributedBugError`` on every rank when something is wrong. A collective
  pending longer than ``hang_timeout`` is diagnosed by the in-rank watchdog, which ends the job.
* ``ddpdoctor.spawn()`` runs ``fn(rank, *args)`` on N local processes (like
  ``torch.multiprocessing.spawn``) with every rank instrumented, watches for hangs, always
  cleans up every process it started, and raises ``DistributedBugError`` on a finding, a hang or
  a rank failure.

Nothing here imports torch at module level: the pytest plugin and the parent of ``spawn`` import
this module and never need torch themselves.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
import zlib
from typing import Any, Callable, Sequence

__all__ = ["DistributedBugError", "check", "spawn"]

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
#: After a rank asked to end the job on a hang, how long the others get to end themselves.
_HANG_EXIT_GRACE_S = 5.0

# Defaults for spawn() set by the pytest marker for the duration of one test.
_spawn_defaults: dict[str, Any] = {}
_PATCHES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rank", "patches").replace(
    "\\", "/")
_env_lock = threading.Lock()


class DistributedBugError(Exception):
    """A distributed bug found by ddpdoctor.

    ``str(err)`` is the rendered report (ranks, source lines, fix); ``findings`` is the list of
    :class:`ddpdoctor.findings.Finding` behind it (empty for a hang or rank failure that no
    check explains); ``hang`` is the watchdog's diagnosis text when the job hung;
    ``rank_errors`` maps a failed rank to its exception and traceback text (``spawn``);
    ``trace_dir`` is a folder holding the traces (``ddpdoctor report DIR`` renders them again).
    """

    def __init__(self, message: str, findings: Sequence | None = None, *, hang: str | None = None,
                 rank_errors: dict[int, str] | None = None, trace_dir: str | None = None) -> None:
        super().__init__(message)
        self.findings = list(findings or [])
        self.hang = hang
        self.rank_errors = dict(rank_errors or {})
        self.trace_dir = trace_dir

    @property
    def categories(self) -> list[str]:
        """The findings' categories, in report order."""
        return [f.category for f in self.findings]


# ------------------------------------------------------------------------------------------
# analysis shared by check() and spawn()


def _limit(fail_on: str) -> int:
    from ..analysis.findings import SEVERITY_RANK

    if fail_on not in _FAIL_ON:
        raise ValueError(f"fail_on must be one of {', '.join(_FAIL_ON)}, not {fail_on!r}")
    return -1 if fail_on == "never" else SEVERITY_RANK[fail_on]


def _analyze(folder: str, fail_on: str, select, ignore):
    """(run, findings at/above fail_on, rendered report) of the traces in folder, or None."""
    from ..analysis.engine import analyze
    from ..analysis.findings import SEVERITY_RANK
    from ..analysis.load import TraceError
    from ..analysis.run import load_run
    from ..render.text import render

    try:
        run = load_run([folder])
    except TraceError:
        return None
    findings, notes = analyze(run, select=select, ignore=ignore)
    limit = _limit(fail_on)
    failing = [f for f in findings if SEVERITY_RANK.get(f.severity, 9) <= limit]
    return run, failing, render(run, failing, notes)


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
    if exc is None:
        return {"t": "exit", "how": "normal", "ts": rec.now_us(), "events": rec.events,
                "seq": rec.position(), "pending_async": len(rec.async_pending), "scope": "check"}
    from ..rank.patches.exit import _user_frame

    file, line, func = _user_frame(exc.__traceback__)
    stack = [[fs.filename, fs.lineno, fs.name, (fs.line or "").strip()]
             for fs in traceback.extract_tb(exc.__traceback__)[-8:]]
    return {"t": "exit", "how": "exception", "exc": f"{type(exc).__name__}: {exc}"[:1000],
            "file": file, "line": line, "func": func, "stack": stack, "ts": rec.now_us(),
            "inflight": [], "scope": "check"}


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
            path = rec.start_session(out, hang, self.on_hang, f"{base}-check{n}")
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
                rec.end_session()
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


# ------------------------------------------------------------------------------------------
# spawn()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(overlay: dict[str, str]):
    """os.environ with overlay while children start (a spawned interpreter inherits the
    environment at start, and the bootstrap must be in place before it imports torch)."""
    with _env_lock:
        saved = {k: os.environ.get(k) for k in overlay}
        os.environ.update(overlay)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _child_main(fn: Callable, rank: int, args: tuple, env: dict[str, str], workdir: str) -> None:
    """Entry of each rank process started by spawn()."""
    os.environ.update(env)  # for start methods that do not exec a new interpreter
    from ..rank import activate
    from ..rank import recorder as recorder_mod
    from ..rank import settings as settings_mod

    rec = recorder_mod.get()
    if rec is not None and rec.writer is None and rec.settings.out != env.get(settings_mod.ENV_OUT):
        rec.settings = settings_mod.from_env()  # forked from a parent with other settings
    if "torch" in sys.modules:
        activate.activate_in_process()
    else:
        activate.install_import_hook()
    # Registered before fn runs, so it runs after fn's own exit handlers and ddpdoctor's (which
    # write the rank's exit record): interpreter teardown of torch takes seconds per rank and
    # adds nothing to a test, so the rank ends there, as multiprocessing's fork children do.
    atexit.register(_fast_exit)
    _exit_status[0] = 1
    try:
        fn(rank, *args)
        _exit_status[0] = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        _exit_status[0] = code
        if code == 0:
            return
        _write_error(workdir, rank, exc)
        raise
    except BaseException as exc:
        _write_error(workdir, rank, exc)
        rec = recorder_mod.get()
        if rec is not None and rec.writer is not None:
            from ..rank.patches.exit import record_exception

            record_exception(rec, exc)
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)


_exit_status = [1]


def _fast_exit() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(_exit_status[0])


def _write_error(workdir: str, rank: int, exc: BaseException) -> None:
    info: dict[str, Any] = {
        "rank": rank, "type": type(exc).__name__, "message": str(exc)[:20000],
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20000:],
        "ddpdoctor": isinstance(exc, DistributedBugError),
        "distributed": _is_distributed_failure(exc),
    }
    if isinstance(exc, DistributedBugError):
        info["findings"] = [f.to_json() for f in exc.findings]
        info["hang"] = exc.hang
    path = os.path.join(workdir, f"rank{rank}.error.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(info, f, default=str)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _scan(workdir: str) -> tuple[bool, list[str]]:
    """(a rank asked to end the job after a hang, the hang diagnosis files) under workdir."""
    kill = False
    texts = []
    for root, _dirs, files in os.walk(workdir):
        for name in files:
            if name == "HANG_KILL":
                kill = True
            elif name.startswith("hang-") and name.endswith(".txt"):
                texts.append(os.path.join(root, name))
    return kill, sorted(texts)


def _read_hang_texts(paths: list[str]) -> str:
    seen: list[str] = []
    for p in paths:
        try:
            with open(p, errors="replace") as f:
                t = f.read().strip()
        except OSError:
            continue
        if t and t not in seen:
            seen.append(t)
    return "\n\n".join(seen)


def _kill_all(procs: list, workdir: str, grace: float) -> None:
    """End every process of this spawn: each rank's whole tree, then anything left that still
    carries this spawn's environment (a grandchild whose parent already exited)."""
    import psutil

    from ..launcher import kill_tree

    def signal_all(targets: list, kill: bool) -> None:
        for t in targets:
            try:
                t.kill() if kill else t.terminate()
            except (psutil.Error, OSError, ValueError):
                pass

    ranks = [p for p in procs if p.is_alive()]
    below = []
    for p in ranks:
        try:
            below.extend(psutil.Process(p.pid).children(recursive=True))
        except psutil.Error:
            pass
    # The ranks themselves are reaped by multiprocessing (so that their exit codes stay
    # readable), their descendants by psutil.
    signal_all(below + ranks, kill=False)
    deadline = time.monotonic() + grace
    for p in ranks:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    _gone, alive = psutil.wait_procs(below, timeout=max(0.0, deadline - time.monotonic()))
    signal_all(alive + [p for p in ranks if p.is_alive()], kill=True)
    for p in ranks:
        p.join(timeout=grace)
    psutil.wait_procs(alive, timeout=grace)
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            stray = proc.environ().get(ENV_CHECK_DIR) == workdir
        except (psutil.Error, OSError):
            continue
        if stray:
            kill_tree(proc.pid, grace=grace)


def _stack_excerpt(trace_dir: str, rank: int, limit: int = 12) -> str:
    """The main thread's stack that a rank's faulthandler wrote when it was ended (SIGTERM)."""
    import glob

    lines: list[str] = []
    for path in sorted(glob.glob(os.path.join(trace_dir, f"rank{rank:05d}-*.stacks.txt"))):
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        i = text.rfind("Current thread")
        if i >= 0:
            block = text[i:].split("\n\n")[0].splitlines()
            lines = [block[0]] + [ln for ln in block[1:] if "/multiprocessing/" not in ln
                                  and "<string>" not in ln and "_child_main" not in ln]
    if not lines:
        return "    (no stack was written)"
    return "\n".join("    " + ln.strip() for ln in lines[:limit])


def _rank_failure(rank: int, exitcode: int | None, err: dict | None) -> str:
    if err is not None:
        return f"rank {rank} raised {err.get('type')}: {err.get('message')}\n{err.get('traceback', '')}".rstrip()
    if exitcode is None:
        return f"rank {rank} was still running"
    if exitcode < 0:
        import signal

        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} exited with status {exitcode}"


def spawn(fn: Callable, world_size: int, timeout: float, args: Sequence = (),
          hang_timeout: float | None = None, start_method: str = "spawn", *,
          fail_on: str | None = None, select: Sequence[str] | None = None,
          ignore: Sequence[str] | None = None) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` local processes and check them.

    Like ``torch.multiprocessing.spawn``: each child gets MASTER_ADDR=127.0.0.1, a free
    MASTER_PORT, RANK, LOCAL_RANK and WORLD_SIZE in its environment, and ``fn`` initialises the
    process group itself (``init_process_group("gloo")`` reads them). Every rank is recorded
    from ``init_process_group`` on, with or without :func:`check` inside ``fn``.

    Returns when every rank has finished and the traces show nothing at or above ``fail_on``
    (default ``error``). Raises :class:`DistributedBugError` on a finding, on a hang
    (collective pending longer than ``hang_timeout`` seconds; the message is the watchdog's
    diagnosis), on a rank failure (with the rank's exception and traceback) and after
    ``timeout`` seconds. Every process it started, and their children, are gone when it
    returns or raises. ``fn`` must be picklable (a module-level function) for the ``spawn``
    start method. On failure the traces are kept in ``err.trace_dir``.
    """
    import multiprocessing
    import multiprocessing.connection

    from .. import launcher

    if hang_timeout is None:
        hang_timeout = _spawn_defaults.get("hang_timeout")
    if fail_on is None:
        fail_on = _spawn_defaults.get("fail_on", "error")
    if select is None:
        select = _spawn_defaults.get("select")
    if ignore is None:
        ignore = _spawn_defaults.get("ignore")
    _limit(fail_on)
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    ctx = multiprocessing.get_context(start_method)
    workdir = tempfile.mkdtemp(prefix="ddpdoctor-spawn-")
    trace_dir = os.path.join(workdir, "trace")
    os.makedirs(trace_dir)
    full = launcher.child_env(trace_dir, hang_timeout if hang_timeout is not None else 0, "kill",
                              uuid.uuid4().hex[:12])
    overlay = {k: v for k, v in full.items() if os.environ.get(k) != v}
    overlay.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                    "WORLD_SIZE": str(world_size), ENV_CHECK_DIR: workdir})
    if start_method != "fork":
        # Started now, without this spawn's environment, so the cleanup sweep leaves it alone.
        try:
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
        except Exception:
            pass
    procs: list = []
    t0 = time.monotonic()
    hang_kill = False
    timed_out = False
    try:
        for rank in range(world_size):
            env = dict(overlay, RANK=str(rank), LOCAL_RANK=str(rank))
            p = ctx.Process(target=_child_main, args=(fn, rank, tuple(args), env, workdir),
                            name=f"ddpdoctor-rank{rank}")
            try:
                with _environ(env):
                    p.start()
            except BaseException:
                # fn or args cannot be sent to a child (a lambda, a local function...): the
                # caller's mistake, raised as is once the ranks already started are gone.
                _kill_all(procs, workdir, grace=2.0)
                shutil.rmtree(workdir, ignore_errors=True)
                raise
            procs.append(p)
        first_failure = None
        while True:
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            now = time.monotonic()
            kill, _texts = _scan(workdir)
            if kill or any(p.exitcode == launcher.EXIT_HANG for p in procs):
                hang_kill = True
                # Each rank ends itself (exit 124) once its watchdog sees the kill flag, after a
                # short grace to write its records; give them that time, then end the rest.
                until = time.monotonic() + _HANG_EXIT_GRACE_S
                while alive and time.monotonic() < until:
                    multiprocessing.connection.wait([p.sentinel for p in alive],
                                                    timeout=until - time.monotonic())
                    alive = [p for p in procs if p.exitcode is None]
                break
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = now
            # After a failure the others usually fail or finish within moments; then we end them.
            if first_failure is not None and now - first_failure > 5.0:
                break
            if now - t0 > timeout:
                timed_out = True
                break
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.1)
    finally:
        still = [i for i, p in enumerate(procs) if p.exitcode is None]
        _kill_all(procs, workdir, grace=2.0)
    exitcodes = {i: p.exitcode for i, p in enumerate(procs)}
    elapsed = time.monotonic() - t0
    _kill_texts = _scan(workdir)[1]
    if not hang_kill and _scan(workdir)[0]:
        hang_kill = True
    hang_text = _read_hang_texts(_kill_texts) if hang_kill else ""
    errors: dict[int, dict] = {}
    for i in range(world_size):
        path = os.path.join(workdir, f"rank{i}.error.json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    errors[i] = json.load(f)
            except (OSError, ValueError):
                pass
    failed = sorted(i for i, c in exitcodes.items() if c not in (0,) or i in errors)
    try:
        analysis = _analyze(trace_dir, fail_on, select, ignore)
        analysis_error = None
    except Exception as exc:  # a broken check must not hide how the ranks ended
        analysis, analysis_error = None, f"{type(exc).__name__}: {exc}"
    if not failed and not hang_kill and not timed_out:
        if analysis is None or not analysis[1]:
            if analysis_error:
                import warnings

                warnings.warn(f"ddpdoctor.spawn: the traces could not be analysed: {analysis_error} "
                              f"(kept in {trace_dir})", RuntimeWarning, stacklevel=2)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
            return None
    from ..trace.ranges import fmt_ranks

    parts: list[str] = []
    findings: list = []
    rank_errors: dict[int, str] = {}
    if timed_out:
        parts.append(f"ddpdoctor.spawn: timed out after {timeout:g} s; rank(s) {fmt_ranks(still)} "
                     "were still running and were ended")
    if hang_kill:
        parts.append(f"ddpdoctor.spawn: a hang was diagnosed and the ranks were ended ({elapsed:.1f} s "
                     "after they started)" + (":\n\n" + hang_text if hang_text else
                                              "; no diagnosis was written"))
    # A rank's DistributedBugError leads when it carries findings (every rank computed the same);
    # one without (a peer did not finish the block) is just that rank's failure.
    ours = [i for i in failed if errors.get(i, {}).get("ddpdoctor") and errors[i].get("findings")]
    if ours:
        err = errors[ours[0]]
        parts.append(err.get("message", ""))
        findings = [_finding_from_json(d) for d in err.get("findings") or []]
        if not hang_text and err.get("hang"):
            hang_text = err["hang"]
    elif analysis is not None:
        # With no finding this is still the table of where each rank was and how it ended.
        parts.append(analysis[2])
        findings = list(analysis[1])
    if analysis_error:
        parts.append(f"(the traces could not be analysed: {analysis_error})")
    # Something other than a backend error ended the job (a hang, a finding, a rank's own
    # exception or a crash): the backend errors of the other ranks are its consequences.
    root_cause = hang_kill or bool(ours) or any(not (errors.get(i) or {}).get("distributed")
                                                for i in failed)
    for i in failed:
        if i in ours or (hang_kill and exitcodes.get(i) == 124 and i not in errors):
            continue
        err = errors.get(i)
        if root_cause and err is not None and err.get("distributed"):
            # The backend's error in a rank whose peers were ended or failed: a consequence.
            text = f"rank {i} then failed in a collective: {err.get('type')}: {str(err.get('message'))[:300]}"
        elif timed_out and i in still and err is None:
            text = f"rank {i} was ended at:\n{_stack_excerpt(trace_dir, i)}"
        else:
            text = _rank_failure(i, exitcodes.get(i), err)
        rank_errors[i] = text
        parts.append(text)
    parts.append(f"(traces kept in {trace_dir}; render them again with: ddpdoctor report {trace_dir})")
    raise DistributedBugError("\n\n".join(p for p in parts if p), findings, hang=hang_text or None,
                              rank_errors=rank_errors, trace_dir=trace_dir)
