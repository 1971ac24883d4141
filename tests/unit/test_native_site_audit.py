"""The C helpers of the recording path that issue #11 added: the call-site walk's pass over
library frames (``rank/_sitewalk.c``) must give the very sites of the Python walk, and the C
audit filter (``rank/_auditfilter.c``) must hand the file hook the same events, arguments and
caller frames as ``sys.addaudithook`` would, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ddpdoctor.rank import callsite
from ddpdoctor.rank.callsite import _STDLIB, SiteTable

sitewalk = pytest.importorskip("ddpdoctor.rank._sitewalk", reason="C extension not built (no compiler)")

#: Plain library code (kind 1: passed over by its globals), as torch's FSDP frames are.
LIB_FILE = os.path.join(_STDLIB[0], "fake_fsdp_collectives.py")
#: A framework (kind 2: part of the site's key), as accelerate is.
FW_FILE = os.path.join(os.sep, "opt", "venv", "lib", "python3.11", "site-packages", "fakefw", "run.py")
LIB_SRC = """
def unshard(table, depth):
    if depth:
        return unshard(table, depth - 1)
    return issue(table)

def issue(table):
    import sys
    return table.at(sys._getframe())
"""
FW_SRC = """
def fit(lib, table):
    return lib["unshard"](table, 3)
"""


def _module(src: str, path: str) -> dict:
    ns: dict = {"__file__": path, "__name__": "fake"}
    exec(compile(src, path, "exec"), ns)
    return ns


def _sites(monkeypatch, native: bool):
    monkeypatch.setattr(callsite, "_site_key", sitewalk.site_key if native else None)
    lib, fw = _module(LIB_SRC, LIB_FILE), _module(FW_SRC, FW_FILE)
    records: list[dict] = []
    table = SiteTable(records.append)
    got = []
    for i in range(6):  # two user lines, twice each, and a framework in between
        if i % 3 == 0:
            got.append(lib["unshard"](table, 12))
        elif i % 3 == 1:
            got.append(lib["unshard"](table, 5))
        else:
            got.append(fw["fit"](lib, table))
    # (the stack's outer frames are this test's two calls of _sites, on two lines)
    return got, [{k: (v[0] if k == "stack" else v) for k, v in r.items() if k != "conds"} for r in records]


def test_the_c_pass_over_library_frames_gives_the_sites_of_the_python_walk(monkeypatch):
    py_ids, py_recs = _sites(monkeypatch, native=False)
    c_ids, c_recs = _sites(monkeypatch, native=True)
    assert c_ids == py_ids and c_recs == py_recs
    # each user line is its own site, however deep the library; the framework path another
    assert len(set(c_ids)) == 3 and c_ids[0] == c_ids[3] and c_ids[1] == c_ids[4]
    assert all(r["file"] == __file__ for r in c_recs)
    assert c_recs[2]["via"].startswith("fakefw fit")


def test_skip_library_stops_at_the_first_frame_not_known_as_library():
    lib = _module(LIB_SRC.replace("table.at(sys._getframe())", "sys._getframe()"), LIB_FILE)
    table = SiteTable(lambda r: None)
    frame = lib["unshard"](table, 4)
    assert sitewalk.skip_library(frame, {}) is frame  # nothing classified yet: no step
    table._classify_globals(frame.f_globals)
    out = sitewalk.skip_library(frame, table._gkind)
    assert out.f_globals is globals()  # this test's frame: the first one outside the library
    with pytest.raises(TypeError):
        sitewalk.skip_library("not a frame", {})


def test_site_key_is_the_key_of_the_python_walk_and_none_for_unclassified_frames(monkeypatch):
    """A hit in SiteTable._at under the C key is the site the Python walk would find; a frame
    the tables do not know yet gives None (the Python walk classifies it). Both keys are taken
    inside the call: the user frame's instruction offset is part of the key."""
    lib = _module(LIB_SRC.replace("table.at(sys._getframe())", "table(sys._getframe())"), LIB_FILE)
    fw = _module(FW_SRC, FW_FILE)
    table = SiteTable(lambda r: None)
    monkeypatch.setattr(callsite, "_site_key", None)
    seen: list = []

    def both(frame):
        before = sitewalk.site_key(frame, table._gkind, table._lib)
        n = len(table._at)
        sid = table.at(frame)  # the Python walk: classifies, stores its key
        py_key = list(table._at)[n]
        seen.append((before, py_key, sitewalk.site_key(frame, table._gkind, table._lib), sid))
        return sid

    lib["unshard"](both, 7)
    fw["fit"](lib, both)
    (b1, k1, c1, s1), (b2, k2, c2, s2) = seen
    assert b1 is None  # nothing classified before the first walk
    assert c1 == k1 and c2 == k2 and s1 != s2
    assert len(k1) == 3 and len(k2) == 5  # the framework frame's (code, offset) is in the key


AUDIT_PROG = textwrap.dedent("""
    import os, sys, tempfile
    from ddpdoctor.rank import auditfilter
    native = os.environ.get("DDPDOCTOR_NATIVE") != "0"
    assert (auditfilter._native is not None) == native
    seen = []
    def hook(event, args, _watched={"open", "os.remove"}):
        if event not in _watched:  # (the Python fall-back sees every event)
            return
        seen.append((event, args[0], sys._getframe(1).f_code.co_name))
    assert auditfilter.add_hook(hook, ["open", "os.remove"]) == native
    d = tempfile.mkdtemp()
    def user():
        p = os.path.join(d, "x")
        open(p, "w").close()
        id(p)
        sys._getframe()
        os.remove(p)
    user()
    print(sorted(s for s in seen if s[1].startswith(d)) == [("open", os.path.join(d, "x"), "user"),
                                ("os.remove", os.path.join(d, "x"), "user")])
    def veto(event, args):
        raise PermissionError("vetoed")
    auditfilter.add_hook(veto, ["os.mkdir"])
    try:
        os.mkdir(os.path.join(d, "y"))
        print("not raised")
    except PermissionError as exc:
        print("raised", exc, os.path.exists(os.path.join(d, "y")))
""")


@pytest.mark.parametrize("native", ["1", "0"])
def test_the_audit_filter_calls_the_hook_for_watched_events_only_with_the_callers_frame(native):
    """In a child process: audit hooks cannot be removed."""
    pytest.importorskip("ddpdoctor.rank._auditfilter", reason="C extension not built (no compiler)")
    env = dict(os.environ, DDPDOCTOR_NATIVE=native)
    env.pop("DDPDOCTOR_OUT", None)
    out = subprocess.run([sys.executable, "-c", AUDIT_PROG], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0] == "True"
    # a hook that raises fails the operation with its exception, as a sys.addaudithook hook does
    assert lines[1] == "raised vetoed False"
