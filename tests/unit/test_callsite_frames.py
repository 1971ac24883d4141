"""The recorded call site is the first frame in the user's code, however deep the library code
between it and the call (issue 15: accelerate's gather recursion), with the library frames kept
as context (``via``, ``lib``)."""

from __future__ import annotations

import os

from ddpdoctor.rank.callsite import LIB_CONTEXT, SiteTable, _is_library

LIB_FILE = os.path.join(os.sep, "opt", "venv", "lib", "python3.11", "site-packages", "fakelib", "ops.py")
LIB_SRC = """
def gather_for_metrics(table, depth):
    return _recurse(table, depth)

def _recurse(table, depth):
    if depth:
        return _recurse(table, depth - 1)
    return table.current(1)

def barrier(table):
    return table.current(1)
"""


def _library():
    ns: dict = {}
    exec(compile(LIB_SRC, LIB_FILE, "exec"), ns)  # a module "installed" under site-packages
    return ns


def test_installed_packages_and_the_standard_library_are_never_the_users_code():
    assert _is_library(LIB_FILE)
    assert _is_library("/usr/lib/python3/dist-packages/accelerate/utils/operations.py")
    assert _is_library(os.__file__)
    assert not _is_library(__file__)


def test_the_site_is_the_users_line_however_deep_the_library():
    lib = _library()
    records: list[dict] = []
    table = SiteTable(records.append)
    sid = lib["gather_for_metrics"](table, 40)  # the user's line
    rec = table.records[sid]
    assert rec["file"] == __file__ and rec["func"] == "test_the_site_is_the_users_line_however_deep_the_library"
    assert rec["src"].startswith('sid = lib["gather_for_metrics"](table, 40)')
    assert rec["via"].startswith("fakelib gather_for_metrics (ops.py:3) ... _recurse (ops.py:")
    assert len(rec["lib"]) == LIB_CONTEXT and rec["lib"][0][2] == "gather_for_metrics"
    assert all(f[0] == LIB_FILE for f in rec["lib"])


def test_one_user_line_through_different_library_code_is_two_sites():
    """A framework's `fit()` line leads to many different collectives: each keeps its own
    library context (a site is its user frames and the framework frames above them)."""
    lib = _library()
    table = SiteTable(lambda rec: None)
    sids = [lib["barrier"](table) if i % 2 else lib["gather_for_metrics"](table, 2) for i in range(4)]
    assert sids[0] == sids[2] and sids[1] == sids[3] and sids[0] != sids[1]
    assert table.records[sids[1]]["via"].startswith("fakelib barrier")
    assert table.records[sids[0]]["line"] == table.records[sids[1]]["line"]  # the same user line


def test_package_metadata_and_ddpdoctors_own_reads_are_not_user_file_operations():
    """At exit, reading a package's metadata (importlib.metadata, an editable install's
    *.egg-info) is no file the ranks share; nor is any file operation ddpdoctor's own code makes."""
    import sys

    import ddpdoctor
    from ddpdoctor.rank.patches.files import _is_metadata, _own_test

    assert _is_metadata("/work/repo/ddpdoctor.egg-info/PKG-INFO")
    assert _is_metadata("/opt/venv/lib/python3.11/site-packages/torch-2.13.0.dist-info/METADATA")
    assert not _is_metadata("/data/run/ckpt.pt")
    own = _own_test()
    assert not own(sys._getframe())  # this test is the user's code
    ns: dict = {}
    inside = os.path.join(os.path.dirname(ddpdoctor.__file__), "render", "fake_module.py")
    exec(compile("import sys\nframe = sys._getframe()\n", inside, "exec"), ns)
    assert own(ns["frame"])
