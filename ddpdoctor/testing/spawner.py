"""``ddpdoctor.spawn()``: run ``fn(rank, *args)`` on N local processes (like
``torch.multiprocessing.spawn``) with every rank instrumented, watch for hangs, always clean up
every process started, and raise ``DistributedBugError`` on a finding, a hang or a rank failure.

Nothing here imports torch at module level: the parent of ``spawn`` never needs torch itself.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
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
from typing import Any, Callable, Sequence

from ..errors import EXIT_HANG, DistributedBugError
from ..trace.files import KILL_MARKER, STACKS_SUFFIX
from .block import ENV_CHECK_DIR, _analyze, _finding_from_json, _is_distributed_failure, _limit

__all__ = ["spawn", "spawn_defaults"]

#: After a rank asked to end the job on a hang, how long the others get to end themselves.
_HANG_EXIT_GRACE_S = 5.0
#: Defaults for spawn() set by the pytest marker for the duration of one test.
_DEFAULTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ddpdoctor_spawn_defaults",
                                                                        default=None)
_env_lock = threading.Lock()


@contextlib.contextmanager
def spawn_defaults(**options: Any):
    """Within the block, ``spawn()`` arguments left at None take these values (hang_timeout,
    fail_on, select, ignore): the pytest marker's options for a test that calls spawn()."""
    token = _DEFAULTS.set({k: v for k, v in options.items() if v is not None})
    try:
        yield
    finally:
        _DEFAULTS.reset(token)


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
            if name == KILL_MARKER:
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
    for path in sorted(glob.glob(os.path.join(trace_dir, f"rank{rank:05d}-*{STACKS_SUFFIX}"))):
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

    defaults = _DEFAULTS.get() or {}
    if hang_timeout is None:
        hang_timeout = defaults.get("hang_timeout")
    if fail_on is None:
        fail_on = defaults.get("fail_on", "error")
    if select is None:
        select = defaults.get("select")
    if ignore is None:
        ignore = defaults.get("ignore")
    _limit(fail_on)
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    ctx = multiprocessing.get_context(start_method)
    workdir = tempfile.mkdtemp(prefix="ddpdoctor-spawn-")
    trace_dir = os.path.join(workdir, "trace")
    os.makedirs(trace_dir)
    overlay = _child_overlay(trace_dir, workdir, world_size, hang_timeout)
    if start_method != "fork":
        # Started now, without this spawn's environment, so the cleanup sweep leaves it alone.
        try:
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
        except Exception:
            pass
    procs: list = []
    t0 = time.monotonic()
    try:
        _start_ranks(ctx, procs, fn, args, overlay, world_size, workdir)
        hang_kill, timed_out = _watch(procs, workdir, t0, timeout)
    finally:
        still = [i for i, p in enumerate(procs) if p.exitcode is None]
        _kill_all(procs, workdir, grace=2.0)
    ended = _Ended(procs, workdir, time.monotonic() - t0, hang_kill, timed_out, still)
    try:
        analysis = _analyze(trace_dir, fail_on, select, ignore)
        analysis_error = None
    except Exception as exc:  # a broken check must not hide how the ranks ended
        analysis, analysis_error = None, f"{type(exc).__name__}: {exc}"
    if not ended.failed and not ended.hang_kill and not timed_out:
        if analysis is None or not analysis[1]:
            if analysis_error:
                import warnings

                warnings.warn(f"ddpdoctor.spawn: the traces could not be analysed: {analysis_error} "
                              f"(kept in {trace_dir})", RuntimeWarning, stacklevel=2)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
            return None
    raise _failure(ended, analysis, analysis_error, trace_dir, timeout)


def _child_overlay(trace_dir: str, workdir: str, world_size: int, hang_timeout: float | None) -> dict:
    """The environment the ranks get on top of this process's (the launcher's injection)."""
    from .. import launcher

    full = launcher.child_env(trace_dir, hang_timeout if hang_timeout is not None else 0, "kill",
                              uuid.uuid4().hex[:12])
    overlay = {k: v for k, v in full.items() if os.environ.get(k) != v}
    overlay.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                    "WORLD_SIZE": str(world_size), ENV_CHECK_DIR: workdir})
    return overlay


def _start_ranks(ctx, procs: list, fn: Callable, args: Sequence, overlay: dict, world_size: int,
                 workdir: str) -> None:
    """Start the ranks, appending each process to ``procs`` as it starts."""
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


def _watch(procs: list, workdir: str, t0: float, timeout: float) -> tuple[bool, bool]:
    """Wait until every rank ended, a hang was diagnosed (the ranks then end themselves), the
    others had a moment after a rank failed, or ``timeout``: (hang_kill, timed_out)."""
    import multiprocessing.connection

    first_failure = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            return False, False
        now = time.monotonic()
        kill, _texts = _scan(workdir)
        if kill or any(p.exitcode == EXIT_HANG for p in procs):
            # Each rank ends itself (exit 124) once its watchdog sees the kill flag, after a
            # short grace to write its records; give them that time, then end the rest.
            until = time.monotonic() + _HANG_EXIT_GRACE_S
            while alive and time.monotonic() < until:
                multiprocessing.connection.wait([p.sentinel for p in alive],
                                                timeout=until - time.monotonic())
                alive = [p for p in procs if p.exitcode is None]
            return True, False
        if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
            first_failure = now
        # After a failure the others usually fail or finish within moments; then we end them.
        if first_failure is not None and now - first_failure > 5.0:
            return False, False
        if now - t0 > timeout:
            return False, True
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.1)


class _Ended:
    """How the ranks of one spawn ended: exit codes, their error files, the hang diagnosis."""

    def __init__(self, procs: list, workdir: str, elapsed: float, hang_kill: bool, timed_out: bool,
                 still: list[int]) -> None:
        self.exitcodes = {i: p.exitcode for i, p in enumerate(procs)}
        self.elapsed = elapsed
        self.timed_out = timed_out
        self.still = still
        kill, texts = _scan(workdir)
        self.hang_kill = hang_kill or kill
        self.hang_text = _read_hang_texts(texts) if self.hang_kill else ""
        self.errors: dict[int, dict] = {}
        for i in range(len(procs)):
            path = os.path.join(workdir, f"rank{i}.error.json")
            if os.path.exists(path):
                try:
                    with open(path) as f:
                        self.errors[i] = json.load(f)
                except (OSError, ValueError):
                    pass
        self.failed = sorted(i for i, c in self.exitcodes.items() if c not in (0,) or i in self.errors)


def _failure(ended: _Ended, analysis, analysis_error: str | None, trace_dir: str,
             timeout: float) -> DistributedBugError:
    """The error spawn() raises: the hang, the findings, each failed rank's part."""
    from ..trace.ranges import fmt_ranks

    errors, failed, hang_text = ended.errors, ended.failed, ended.hang_text
    parts: list[str] = []
    findings: list = []
    rank_errors: dict[int, str] = {}
    if ended.timed_out:
        parts.append(f"ddpdoctor.spawn: timed out after {timeout:g} s; rank(s) {fmt_ranks(ended.still)} "
                     "were still running and were ended")
    if ended.hang_kill:
        parts.append(f"ddpdoctor.spawn: a hang was diagnosed and the ranks were ended ({ended.elapsed:.1f} s "
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
    root_cause = ended.hang_kill or bool(ours) or any(not (errors.get(i) or {}).get("distributed")
                                                      for i in failed)
    for i in failed:
        if i in ours or (ended.hang_kill and ended.exitcodes.get(i) == EXIT_HANG and i not in errors):
            continue
        err = errors.get(i)
        if root_cause and err is not None and err.get("distributed"):
            # The backend's error in a rank whose peers were ended or failed: a consequence.
            text = f"rank {i} then failed in a collective: {err.get('type')}: {str(err.get('message'))[:300]}"
        elif ended.timed_out and i in ended.still and err is None:
            text = f"rank {i} was ended at:\n{_stack_excerpt(trace_dir, i)}"
        else:
            text = _rank_failure(i, ended.exitcodes.get(i), err)
        rank_errors[i] = text
        parts.append(text)
    parts.append(f"(traces kept in {trace_dir}; render them again with: ddpdoctor report {trace_dir})")
    return DistributedBugError("\n\n".join(p for p in parts if p), findings, hang=hang_text or None,
                               rank_errors=rank_errors, trace_dir=trace_dir)
