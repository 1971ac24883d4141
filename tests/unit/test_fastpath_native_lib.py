"""Library callers on the C repeat-call path (rank/_fastcall.c's lib_hit): a collective called
by library code (FSDP2's) is recorded from the Hit stored under (key, the user's site), by the
C path where it is built, by libcalls.replay without it, and both write the same bytes, the
same in-flight entries and the same sequence numbers. In-process, with a stand-in recorder."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from test_fastpath_native import _all_reduce, _norm, _Rec  # noqa: E402

from ddpdoctor.rank.patches import dist as patch_dist  # noqa: E402
from ddpdoctor.rank.patches import fastpath, libcalls  # noqa: E402

native = pytest.importorskip("ddpdoctor.rank._fastcall", reason="C extension not built (no compiler)")

ENT = ("0", '{"t":"c","op":"all_reduce","g":"0","s":', ',"x":["float32[1]"]', "", "all_reduce", True,
       False, "", None)
# a "library" module: its globals are classified as plain library code in the stand-in tables
LIB: dict = {}
exec("def lib_call(w, t):\n    return w(t)\n", LIB)  # noqa: S102 - a module-like namespace


class _Sites:
    """rec.sites: _gkind as callsite.SiteTable keeps it; at(frame) the user's line further out."""

    def __init__(self) -> None:
        self._gkind = {object.__hash__(LIB): (LIB, 1)}
        self.at_calls = 0

    def at(self, frame) -> int:
        self.at_calls += 1
        return 100 + frame.f_back.f_lineno  # the line that called the library function


def _run(use_native: bool, monkeypatch) -> dict:
    rec = _Rec()
    rec.sites = _Sites()
    monkeypatch.setattr(fastpath, "recorder_mod", types.SimpleNamespace(_recorder=rec))
    monkeypatch.setattr(fastpath, "_native", native if use_native else None)
    replays: list = []
    real_replay = libcalls.replay

    def replay(*a, **k):
        replays.append(1)
        return real_replay(*a, **k)

    monkeypatch.setattr(libcalls, "replay", replay)
    params, defaults = patch_dist._signature(_all_reduce)
    fastkey = fastpath.key_function(params, defaults, ("tensor",), ("group", "op", "async_op"),
                                    patch_dist._ABSENT)
    lib: dict = {}
    seen: list = []

    def orig(tensor, op="SUM", group=None, async_op=False):
        # what the watchdog sees during the call (the entries without their start time)
        seen.append((_norm(bytes(rec.slot._mm).rstrip(b"\0")), [v[:4] for v in rec.inflight.values()]))

    def general(rec, tid, frame, fkey, fast, args, kwargs):
        # dist's general path for a library caller: replay a stored Hit, else store one
        gk = rec.sites._gkind.get(object.__hash__(frame.f_globals))
        assert fkey is not None and gk is not None and gk[1]
        site = rec.sites.at(frame)
        h = lib.get((fkey, site))
        if h is not None and h.rec is rec:
            return libcalls.replay(h, rec, tid, orig, args, kwargs, failed, lambda *a: None)
        rec.general_calls += 1
        lib[(fkey, site)] = fastpath.make_hit(rec, ENT, site, frame.f_code)
        return orig(*args, **kwargs)

    def failed(*a):
        raise AssertionError("no call fails here")

    w = fastpath.make_wrapper(orig, fastkey, general, True, (lambda: False, types.SimpleNamespace(
        _is_compiling_flag=False)), (failed, lambda *a: None), lib)
    assert isinstance(getattr(w, "_ddpdoctor_native", None), native.Wrapper) == use_native
    t = torch.ones(1)
    for _ in range(3):  # one library line reached from two user lines: two sites
        LIB["lib_call"](w, t)
        LIB["lib_call"](w, t)
    return {"records": [_norm(d) for d in rec.writer.mm.data], "seen": seen, "seq": rec.seq,
            "events": rec.events, "general": rec.general_calls, "after": rec.inflight,
            "sites": sorted({k[1] for k in lib}), "replays": len(replays), "errors": rec.errors}


def test_library_callers_are_recorded_by_the_c_path_as_by_the_python_replay(monkeypatch):
    py = _run(False, monkeypatch)
    c = _run(True, monkeypatch)
    assert py["replays"] == 4 and c["replays"] == 0  # the repeat calls: Python replay / C path
    for r in (py, c):
        del r["replays"]
    assert c == py
    assert py["general"] == 2 and len(py["sites"]) == 2 and py["events"] == 4
    assert len(py["seen"]) == 6 and py["after"] == {} and py["errors"] == []
    s1, s2 = py["sites"]
    assert py["records"] == [
        b'{"t":"c","op":"all_reduce","g":"0","s":%d,"x":["float32[1]"],"ts":N,"d":N,"site":%d}\n' % (i, s)
        for i, s in ((1, s1), (2, s2), (3, s1), (4, s2))]


def test_a_site_lookup_that_raises_leaves_the_call_to_the_general_path(monkeypatch):
    calls: list = []

    class Broken(_Sites):
        def at(self, frame):
            calls.append(frame)
            raise KeyError("table gone")

    rec = _Rec()
    rec.sites = Broken()
    monkeypatch.setattr(fastpath, "recorder_mod", types.SimpleNamespace(_recorder=rec))
    monkeypatch.setattr(fastpath, "_native", native)
    params, defaults = patch_dist._signature(_all_reduce)
    fastkey = fastpath.key_function(params, defaults, ("tensor",), ("group", "op", "async_op"),
                                    patch_dist._ABSENT)
    general_calls: list = []

    def general(rec, tid, frame, fkey, fast, args, kwargs):
        general_calls.append(fkey)
        return "general"

    w = fastpath.make_wrapper(lambda *a, **k: "torch", fastkey, general, True, (lambda: False, types.SimpleNamespace(
        _is_compiling_flag=False)), (None, None), {})
    assert LIB["lib_call"](w, torch.ones(1)) == "general"
    assert len(calls) == 1 and len(general_calls) == 1 and rec.writer.mm.data == []


def test_the_site_is_read_in_place_as_site_table_at_finds_it(monkeypatch):
    """With a real SiteTable: the C path reads the site's key on the interpreter's frames
    (3.11) and finds the id SiteTable.at gave the first call; it calls at() only on a miss."""
    import sys

    from ddpdoctor.rank.callsite import SiteTable

    class Counting(SiteTable):
        calls = 0

        def at(self, f):
            Counting.calls += 1
            return super().at(f)

    out = {}
    for use_native in (False, True):
        Counting.calls = 0
        sites = Counting(lambda rec: None)
        sites._gkind[object.__hash__(LIB)] = (LIB, 1)  # LIB is a library module here
        monkeypatch.setattr(_Sites, "__new__", lambda cls, s=sites: s)
        monkeypatch.setattr(_Sites, "__init__", lambda self: None)
        out[use_native] = _run(use_native, monkeypatch)
        out[use_native]["at_calls"] = Counting.calls
    py, c = out[False], out[True]
    assert py["at_calls"] == 6  # the general path's lookup, every call
    if sys.version_info[:2] == (3, 11):
        # twice for each of the two first calls (the C path's miss, then the general path's)
        assert c["at_calls"] == 4
    for r in (py, c):
        del r["replays"], r["at_calls"]
    assert c == py and len(py["sites"]) == 2 and py["general"] == 2


def test_calls_with_keyword_arguments_are_keyed_in_c_as_the_python_key_keys_them(monkeypatch):
    """A group given is passed by keyword (fastpath._exact_shim), FSDP2's form: the C path keys
    the call from key_function's kwplan, the same tuple as the Python key, and records the
    repeat calls itself."""
    from test_fastpath_native import _build

    calls: list = []
    w, rec, _, _ = _build(True, monkeypatch, lambda *a, **k: calls.append((a, k)))
    t = torch.ones(2)
    for _ in range(3):
        w(t, group="g1")
        w(t, "MAX", "g2", async_op=False)
        w(tensor=t, group="g1", async_op=False)
    assert len(calls) == 9 and rec.general_calls == 3  # one a call site
    assert [a == b and a[3] == -1 for a, b in rec.keys] == [True, True, True]
    assert rec.keys[0][0][4:] == rec.keys[2][0][4:]  # the same terms, however passed
    assert len(rec.writer.mm.data) == 6 and rec.inflight == {} and rec.errors == []


def test_inside_is_true_only_inside_a_call_the_c_path_records(monkeypatch):
    """_fastcall.Inside, which the shim tests before the C path: true in the collective's own
    call (where torch calls another patched collective), false outside it and for another
    recorder module; it never raises into the user's call."""
    from test_fastpath_native import _build

    seen: list = []

    def orig(*a, **k):
        seen.append((bool(inside), bool(other), bool(broken)))

    w, rec, _, _ = _build(True, monkeypatch, orig)
    inside = native.Inside(fastpath.recorder_mod)
    other = native.Inside(types.SimpleNamespace(_recorder=object()))
    broken = native.Inside(types.SimpleNamespace())  # no _recorder: False, no error
    t = torch.ones(1)
    for _ in range(3):
        w(t)
    # the first call takes the general path (not recorded here), the repeat ones the C path
    assert seen == [(False, False, False), (True, False, False), (True, False, False)]
    assert not inside and rec.general_calls == 1
