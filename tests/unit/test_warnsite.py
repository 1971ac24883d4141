"""warnsite: a warning's stacklevel is counted over ddpdoctor's own frames."""

from __future__ import annotations

import os
import warnings

import pytest

from ddpdoctor.rank import warnsite

LIBRARY = """
import warnings
def lib(level):
    warnings.warn("from the library", UserWarning, stacklevel=level)
"""
# A wrapper whose code object lives in a ddpdoctor file, as the rank-side patches do.
WRAPPER = """
def wrapper(level):
    return lib(level)
"""
USER = """
def user_a(level):
    return wrapper(level)
def user_b(level):
    return wrapper(level)
"""


@pytest.fixture(params=["python", "native"])
def native(request):
    """Both implementations: the Python function and the C one (skipped where not built)."""
    if request.param == "native" and warnsite._native() is None:
        pytest.skip("the _warnsite extension is not built (or DDPDOCTOR_NATIVE=0)")
    return request.param == "native"


@pytest.fixture
def program(monkeypatch):
    """Three code objects in three files: user.py -> ddpdoctor/rank/fakewrap.py -> lib.py.
    warnings.warn and warnsite's state are restored after the test."""
    monkeypatch.setattr(warnings, "warn", warnings.warn)
    monkeypatch.setitem(warnsite._state, "real", None)
    ns: dict = {}
    exec(compile(LIBRARY, "/elsewhere/lib.py", "exec"), ns)
    exec(compile(WRAPPER, os.path.join(warnsite._PACKAGE, "rank", "fakewrap.py"), "exec"), ns)
    exec(compile(USER, "/elsewhere/user.py", "exec"), ns)
    return ns


def _record(fn, level):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("default")
        fn(level)
    return [(os.path.basename(w.filename), w.lineno) for w in got]


def test_without_it_the_warning_names_the_wrapper(program):
    assert _record(program["user_a"], 2) == [("fakewrap.py", 3)]


def test_stacklevel_steps_over_ddpdoctor_frames(program, native):
    warnsite.install(native)
    assert _record(program["user_a"], 2) == [("user.py", 3)]
    assert _record(program["user_a"], 1) == [("lib.py", 4)]
    assert _record(program["user_a"], 0) == [("lib.py", 4)]


def test_each_call_site_is_its_own_location_again(program, native):
    """The 'default' action shows a warning once per location: through the wrapper, the two
    call sites were one location; now each is shown."""
    warnsite.install(native)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("default")
        for _ in range(2):
            program["user_a"](2)
            program["user_b"](2)
    assert sorted((os.path.basename(w.filename), w.lineno) for w in got) == [("user.py", 3), ("user.py", 5)]


def test_bad_stacklevel_fails_as_without_it(program, native):
    warnsite.install(native)
    with pytest.raises(TypeError):
        warnings.warn("x", UserWarning, stacklevel="2")
    # a level beyond the stack is accepted, as by the real warn
    assert len(_record(program["user_a"], 50)) == 1


def test_the_native_function_is_the_one_installed_where_built(program):
    warnsite.install()
    if warnsite._native() is not None:
        assert type(warnings.warn).__name__ == "builtin_function_or_method"
        assert warnings.warn.__module__ == "ddpdoctor.rank._warnsite" or "warnsite" in repr(warnings.warn)
    # keyword and positional stacklevel alike
    ns = {}
    exec(compile("import warnings\ndef lib(level):\n    warnings.warn('k', UserWarning, level)\n",
                 "/elsewhere/lib2.py", "exec"), ns)
    program["lib"] = ns["lib"]
    assert _record(program["user_a"], 2) == [("user.py", 3)]
