"""The C repeat-call path (ddpdoctor/rank/_fastcall.c) against the Python one it replaces
(rank/patches/fastpath.make_wrapper's ``wrapper``): the same bytes in the in-flight slot and
the trace, the same ``rec.inflight`` entry during the call, the same ``failed(...)`` and the
user's exception re-raised unchanged. In-process, with a stand-in recorder."""

from __future__ import annotations

import functools
import inspect
import os
import re
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from ddpdoctor.rank.patches import dist as patch_dist  # noqa: E402
from ddpdoctor.rank.patches import fastpath  # noqa: E402

native = pytest.importorskip("ddpdoctor.rank._fastcall", reason="C extension not built (no compiler)")


class Boom(RuntimeError):
    pass


class _Mapped:
    """The trace file's mmap: what was written, in order."""

    def __init__(self) -> None:
        self.data: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.data.append(data)
        return len(data)


class _Rec:
    """The attributes of rank.recorder.Recorder the fast path reads and writes."""

    def __init__(self) -> None:
        self.enabled = True
        self.local = types.SimpleNamespace(depth=0)
        self.inflight: dict = {}
        self.seq: dict = {}
        self.t0_ns = 0
        self.slot = types.SimpleNamespace(_mm=bytearray(16384))
        self.writer = types.SimpleNamespace(mm=_Mapped())
        self.ddp_refs: list = []
        self.events = 0
        self.last_event = None
        self.errors: list = []
        self.general_calls = 0

    def emit_bytes(self, data: bytes) -> None:
        self.writer.mm.data.append(data)

    def internal_error(self, exc: BaseException) -> None:
        self.errors.append(exc)


def _all_reduce(tensor, op="SUM", group=None, async_op=False):
    """The shape of torch's all_reduce signature."""


def _build(use_native: bool, monkeypatch, orig):
    """A wrapper around ``orig`` made by make_wrapper, with the C path or without."""
    rec = _Rec()
    monkeypatch.setattr(fastpath, "recorder_mod", types.SimpleNamespace(_recorder=rec))
    monkeypatch.setattr(fastpath, "_native", native if use_native else None)
    params, defaults = patch_dist._signature(_all_reduce)
    fastkey = fastpath.key_function(params, defaults, ("tensor",), ("group", "op", "async_op"),
                                    patch_dist._ABSENT)
    failed_calls: list = []
    keys: list = []

    def failed(rec, exc, begin, site, start, key):
        failed_calls.append((exc, re.sub(r'"ts":\d+', '"ts":T', begin), site, key[:3]))

    def general(rec, tid, frame, fkey, fast, args, kwargs):
        # stands in for dist's general path: records nothing, stores the Hit for next time
        rec.general_calls += 1
        # the key the C path built (from key_function's plan) is the Python key function's
        b = frame.f_back
        keys.append((fkey, fastkey(args, kwargs, object.__hash__(frame.f_code), frame.f_lasti,
                                   -1 if b is None else b.f_lasti)))
        # (as dist's general path reads it: passed by name, or fourth by position as the C
        # path's shim passes every parameter)
        asy = bool(kwargs.get("async_op", args[3] if len(args) > 3 else False))
        ent = ("0", '{"t":"c","op":"all_reduce","g":"0","s":', ',"x":["float32[1]"]',
               ',"async":1' if asy else "", "all_reduce", True, asy, "", None)
        if fkey is not None:
            fast[fkey] = fastpath.make_hit(rec, ent, 7, frame.f_code)
        return orig(*args, **kwargs)

    tracked: list = []
    w = fastpath.make_wrapper(orig, fastkey, general, True, (lambda: False, types.SimpleNamespace(
        _is_compiling_flag=False)), (failed, lambda *a: tracked.append(a[2:])))
    assert isinstance(w, types.FunctionType)  # what torch.distributed exposes: Dynamo traces it
    assert isinstance(getattr(w, "_ddpdoctor_native", None), native.Wrapper) == use_native
    rec.keys = keys
    return w, rec, failed_calls, tracked


def _norm(b: bytes) -> bytes:
    return re.sub(rb'"(ts|d)":\d+', rb'"\1":N', b)


def _run(use_native: bool, monkeypatch) -> dict:
    seen: list = []
    holder: dict = {}

    def orig(tensor, op="SUM", group=None, async_op=False):
        rec = holder["rec"]
        # what the watchdog sees during the call: the slot and the inflight entry
        seen.append((_norm(bytes(rec.slot._mm).rstrip(b"\0")), dict(rec.inflight)))
        return "work" if async_op else None

    w, rec, failed_calls, tracked = _build(use_native, monkeypatch, orig)
    holder["rec"] = rec
    results = []
    for _ in range(3):
        results.append(w(torch.ones(1)))
        results.append(w(torch.ones(1), async_op=True))
    inflight_during = [(k, (v[0], v[1], v[2], v[3])) for s in seen for k, v in s[1].items()]
    return {"results": results, "slots": [s[0] for s in seen], "inflight": inflight_during,
            "records": [_norm(d) for d in rec.writer.mm.data], "events": rec.events,
            "last": rec.last_event[:4], "seq": rec.seq, "general": rec.general_calls,
            "after": rec.inflight, "tracked": tracked, "errors": rec.errors,
            "keys_agree": [a == b and a is not None for a, b in rec.keys]}


def test_native_records_what_python_records(monkeypatch):
    py = _run(False, monkeypatch)
    c = _run(True, monkeypatch)
    assert c == py
    assert py["general"] == 2 and py["records"] and len(py["slots"]) == 6  # 4 repeat calls
    assert c["keys_agree"] == [True, True]
    # (the stand-in general path numbers nothing: the repeat calls are 1 to 4)
    assert py["records"][:2] == [
        b'{"t":"c","op":"all_reduce","g":"0","s":1,"x":["float32[1]"],"ts":N,"d":N,"site":7}\n',
        b'{"t":"c","op":"all_reduce","g":"0","s":2,"x":["float32[1]"],"ts":N,"d":N,"site":7,"async":1}\n']
    assert py["tracked"] == [("all_reduce", "0", 2, 7, ""), ("all_reduce", "0", 4, 7, "")]


@pytest.mark.parametrize("use_native", [False, True])
def test_exception_is_recorded_and_reraised_unchanged(use_native, monkeypatch):
    boom = Boom("peer gone")

    def orig(tensor, op="SUM", group=None, async_op=False):
        calls.append(tensor)
        if len(calls) > 1:
            raise boom

    calls: list = []
    w, rec, failed_calls, _ = _build(use_native, monkeypatch, orig)
    caught = []
    for _ in range(2):  # the general path, which stores the Hit, then the repeat call
        try:
            w(torch.ones(1))
        except Boom as exc:
            caught.append(exc)
    assert caught == [boom] and boom.__cause__ is None and boom.__context__ is None
    tb = boom.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "orig"  # raised where the collective raised it
    assert failed_calls == [(boom, '{"t":"c","op":"all_reduce","g":"0","s":1,"x":["float32[1]"],"ts":T',
                             7, ("all_reduce", "0", 1))]
    assert rec.inflight == {} and rec.events == 0 and rec.writer.mm.data == []


@pytest.mark.parametrize("use_native", [False, True])
def test_not_tracing_and_nested_calls_go_straight_to_torch(use_native, monkeypatch):
    calls: list = []
    w, rec, _, _ = _build(use_native, monkeypatch, lambda *a, **k: calls.append((a, k)) or "r")
    rec.local.depth = 1
    assert w(1, op="MAX") == "r"
    rec.local.depth = 0
    rec.enabled = False
    assert w(2) == "r"
    assert calls == [((1,), {"op": "MAX"}), ((2,), {})] and rec.general_calls == 0


def test_wrapper_takes_functools_wraps_and_marks(monkeypatch):
    w, _, _, _ = _build(True, monkeypatch, _all_reduce)
    w = functools.wraps(_all_reduce)(w)
    setattr(w, patch_dist._PATCHED_MARK, True)
    assert w.__name__ == "_all_reduce" and w.__doc__ == _all_reduce.__doc__
    assert getattr(w, patch_dist._PATCHED_MARK) is True
    assert list(inspect.signature(w).parameters) == ["tensor", "op", "group", "async_op"]


def test_native_off_by_environment():
    env = dict(os.environ, DDPDOCTOR_NATIVE="0")
    code = "from ddpdoctor.rank.patches import fastpath; print(fastpath._native)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "None", out.stderr
