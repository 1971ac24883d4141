"""File operations of a rank, for the missing-barrier check, through Python's audit hooks.

An audit hook sees every ``open``/``os.remove``/``os.rename``/``os.mkdir`` (torch.save and
torch.load included) for the price of one Python call per audit event. Each recorded operation
carries the rank's position in every group's collective sequence (a vector clock), so the
checker can decide happens-before across ranks from the collectives, not from timing.
"""

from __future__ import annotations

import functools
import os
import sys

from ...trace import files as tracefiles
from .. import auditfilter
from . import WRAPPED

_WATCH = {"open": None, "os.remove": "rm", "os.rename": "mv", "os.mkdir": "mkdir",
          "os.rmdir": "rm", "shutil.rmtree": "rm", "os.truncate": "w",
          # raised by our torch.save wrapper: torch writes ASCII paths from C++ (no "open" event)
          "ddpdoctor.write": "w",
          # existence checks and listings are reads (probes.py raises ddpdoctor.stat for os.stat)
          "ddpdoctor.stat": "r", "os.listdir": "r", "os.scandir": "r", "glob.glob/2": "r"}
#: The os.stat wrapper's file: its frames are skipped when deciding whose existence check it is.
_PROBES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probes.py")
#: Audit events that only look at a path: the record's ``probe`` field.
_PROBES = {"ddpdoctor.stat": "stat", "os.listdir": "listdir", "os.scandir": "listdir", "glob.glob/2": "glob"}
#: Position of the ``dir_fd`` argument per event: a path relative to a directory descriptor
#: (shutil.rmtree's inner calls) cannot be resolved here; the outer event covers it.
_DIR_FD_ARG = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 2, "os.rename": 2, "shutil.rmtree": 1}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
#: Record at most this many file operations per rank (a dataset of a million files would
#: otherwise fill the trace); the trace says when the cap was reached.
MAX_RECORDS = 20000


def _ignored_prefixes(rec) -> tuple[str, ...]:
    import site
    import sysconfig

    prefixes = {"/proc/", "/sys/", "/dev/", sys.prefix + os.sep, sys.base_prefix + os.sep,
                sys.exec_prefix + os.sep}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        try:
            prefixes.add(sysconfig.get_paths()[key] + os.sep)
        except KeyError:
            pass
    try:
        prefixes.update(p + os.sep for p in site.getsitepackages())
    except AttributeError:
        pass
    if rec.settings.out:
        prefixes.add(os.path.abspath(rec.settings.out) + os.sep)
    return tuple(prefixes)


def _torch_internal_test():
    """A predicate on the calling frame: is this file operation torch's own machinery (compile
    caches, extension builds), which manages its own concurrency (atomic renames, locks)?
    torch.save/torch.load (serialization.py) are the user's operations and stay recorded."""
    import sysconfig

    try:
        import torch

        torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    except Exception:
        return lambda frame: False
    passthrough = {os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep}
    for key in ("stdlib", "platstdlib"):
        try:
            passthrough.add(sysconfig.get_paths()[key] + os.sep)
        except KeyError:
            pass
    skip = tuple(passthrough) + ("<frozen ",)
    user_io = (os.sep + "serialization.py",)

    def internal(frame) -> bool:
        while frame is not None:
            fn = frame.f_code.co_filename
            if fn.startswith(torch_dir):  # first: a venv's stdlib path is a prefix of site-packages
                return not fn.endswith(user_io)
            if not fn.startswith(skip):
                return False
            frame = frame.f_back
        return False

    return internal


def _is_metadata(path: str) -> bool:
    """Package metadata (``*.dist-info``, ``*.egg-info``: read by importlib.metadata, entry points,
    version checks) is never a file the ranks share as data."""
    return (".dist-info" + os.sep in path or ".egg-info" + os.sep in path
            or path.endswith((".dist-info", ".egg-info")))


def _own_test():
    """A predicate on the calling frame: is this file operation ddpdoctor's own (its first caller
    outside the standard library is ddpdoctor: reading sources for call sites, exit handling)?"""
    import sysconfig

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
    stdlib = {os.path.dirname(os.__file__) + os.sep}
    for key in ("stdlib", "platstdlib"):
        try:
            stdlib.add(sysconfig.get_paths()[key] + os.sep)
        except KeyError:
            pass
    skip = tuple(stdlib) + ("<frozen ",)

    def own(frame) -> bool:
        while frame is not None:
            fn = frame.f_code.co_filename
            if fn.startswith(here):
                return True
            if not fn.startswith(skip) or "-packages" + os.sep in fn:
                return False
            frame = frame.f_back
        return False

    return own


#: Filesystems that live on one machine: the same path on two hosts is two different files.
_LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "ramfs",
                       "devtmpfs", "f2fs", "vfat", "exfat", "ntfs", "ntfs3", "jfs", "reiserfs",
                       "squashfs", "hugetlbfs"})


def _local_fs_test():
    """A predicate on a path: is it on a machine-local filesystem (from /proc/mounts; unknown
    or network filesystems, NFS, Lustre, GPFS, FUSE, count as shared)?"""
    try:
        with open("/proc/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return lambda path: False
    mounts = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 3:
            mounts.append((parts[1].replace("\\040", " ").rstrip("/") + "/", parts[2]))
    mounts.sort(key=lambda m: len(m[0]), reverse=True)
    cache: dict[str, bool] = {}

    def is_local(path: str) -> bool:
        d = os.path.dirname(path) + "/"
        hit = cache.get(d)
        if hit is None:
            hit = next((fs in _LOCAL_FS for mp, fs in mounts if d.startswith(mp)), False)
            if len(cache) < 4096:
                cache[d] = hit
        return hit

    return is_local


def install(rec) -> None:
    if "files" in rec.installed:
        return
    rec.installed.add("files")
    ignored = _ignored_prefixes(rec)
    torch_internal = _torch_internal_test()
    own = _own_test()
    is_local = _local_fs_test()
    ignored_suffixes = (".py", ".pyc", ".so", ".pth", tracefiles.SUFFIX, tracefiles.STACKS_SUFFIX)
    seen: set = set()
    state = {"n": 0}
    from .. import recorder as recorder_mod

    def hook(event, args, _watched=_WATCH.keys()):
        # With the C filter (auditfilter.py) only watched events get here; through
        # sys.addaudithook every audit event of the process does (id(), frame attribute
        # reads...), and the ones not watched leave after one membership test.
        if event not in _watched:
            return
        op = _WATCH[event]
        r = recorder_mod.get()
        if r is None or r.writer is None or not r.enabled or getattr(r.local, "in_audit", False):
            return
        r.local.in_audit = True
        try:
            path = args[0] if args else None
            if isinstance(path, bytes):
                path = os.fsdecode(path)
            if not isinstance(path, str):
                return
            probe = _PROBES.get(event)
            if probe == "glob":  # (pattern, recursive, root_dir, dir_fd)
                if len(args) > 3 and args[3] is not None:
                    return
                if len(args) > 2 and isinstance(args[2], (str, bytes)):
                    path = os.path.join(os.fsdecode(args[2]), path)
            i = _DIR_FD_ARG.get(event)
            if i is not None and len(args) > i and args[i] not in (None, -1):  # -1: no dir_fd
                return
            append = False
            if op is None:  # open: decide read or write from the mode/flags
                mode, flags = (args[1], args[2]) if len(args) >= 3 else (args[1] if len(args) > 1 else "r", 0)
                if isinstance(mode, str) and mode:
                    op = "w" if any(c in mode for c in "wax+") else "r"
                    append = "a" in mode
                else:
                    op = "w" if (flags or 0) & _WRITE_FLAGS else "r"
                    append = bool((flags or 0) & os.O_APPEND)
            path = os.path.abspath(path)
            if path.startswith(ignored) or path.endswith(ignored_suffixes):
                return
            caller = sys._getframe(1)
            if event == "ddpdoctor.stat":  # raised by the os.stat wrapper: judge who called os.stat
                while caller is not None and caller.f_code.co_filename == _PROBES_FILE:
                    caller = caller.f_back
            if torch_internal(caller) or _is_metadata(path) or \
                    (event != "ddpdoctor.write" and own(caller)):
                return
            pos = r.position()
            done = _completed(r, pos)
            dl = getattr(r.local, "dl", None)  # set by coverage.py while a DataLoader draws a batch
            key = (op, path, tuple(sorted(pos.items())), tuple(sorted(done.items())), probe,
                   tuple(dl) if dl else None)
            if key in seen:
                return
            if state["n"] >= MAX_RECORDS:
                if state["n"] == MAX_RECORDS:
                    state["n"] += 1
                    r.emit({"t": "file_cap", "max": MAX_RECORDS, "ts": r.now_us()})
                return
            seen.add(key)
            state["n"] += 1
            rec_ = {"t": "file", "op": op, "path": path, "pos": pos, "ts": r.now_us(),
                    "site": r.sites.current(2)}
            if done:
                rec_["done"] = done
            if append:
                rec_["app"] = 1
            if dl:
                rec_["dl"] = dl
            if is_local(path):
                rec_["loc"] = 1  # compared only with ranks on the same host
            if probe is not None:
                rec_["probe"] = probe
                if probe == "stat" and len(args) > 1 and args[1]:
                    rec_["miss"] = 1  # the path did not exist
            if event == "os.rename" and len(args) > 1 and isinstance(args[1], (str, bytes)):
                rec_["to"] = os.path.abspath(os.fsdecode(args[1]))
            r.emit(rec_)
        except Exception as exc:
            r.internal_error(exc)
        finally:
            r.local.in_audit = False

    auditfilter.add_hook(hook, _WATCH)
    _patch_torch_save()
    from . import probes

    probes.install(rec)


def _completed(r, pos: dict) -> dict:
    """Groups whose latest sequence events are not complete yet (a collective in flight on
    another thread, ``async_op`` work not waited for): the count of completed events there.
    ``pos`` counts issued events; a later completed event implies the earlier ones (in order
    per group), so only the trailing unfinished ones are subtracted."""
    pending: dict = {}
    for info in list(r.inflight.values()) + list(r.async_pending.values()):
        try:
            pending.setdefault(info[1], set()).add(int(info[2]))
        except (IndexError, TypeError, ValueError):
            continue
    out = {}
    for g, seqs in pending.items():
        c = pos.get(g, 0)
        while c in seqs:
            c -= 1
        if c != pos.get(g, 0):
            out[g] = c
    return out


def _patch_torch_save() -> None:
    """torch.save hands an ASCII path to C++, which opens it without an audit event: raise one."""
    try:
        from torch import serialization
    except Exception:
        return
    cls = getattr(serialization, "_open_zipfile_writer_file", None)
    orig = getattr(cls, "__init__", None)
    if orig is None or getattr(orig, WRAPPED, False):
        return

    @functools.wraps(orig)
    def __init__(self, name, *args, **kwargs):
        if isinstance(name, (str, bytes, os.PathLike)):
            sys.audit("ddpdoctor.write", os.fspath(name))
        return orig(self, name, *args, **kwargs)

    setattr(__init__, WRAPPED, True)
    cls.__init__ = __init__
