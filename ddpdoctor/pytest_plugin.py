"""pytest plugin (entry point ``pytest11``): one line for a test to run under ddpdoctor.

``@pytest.mark.ddpdoctor(hang_timeout=10, fail_on="error", select=None, ignore=None)``

* In a test process that already has the default process group (pytest started on every rank
  by ``torchrun ... -m pytest``, the group initialised by a fixture), the test body runs inside
  ``ddpdoctor.check(...)`` with these options.
* Otherwise the options become the defaults of the ``ddpdoctor.spawn(...)`` calls the test makes.

A test that fails with ``DistributedBugError`` shows ddpdoctor's report as its failure text
instead of a long traceback. The plugin is inert for tests that use none of this, and imports
neither torch nor the rest of ddpdoctor when pytest loads it.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable

import pytest

_MARK = "ddpdoctor"
_OPTIONS = ("hang_timeout", "fail_on", "select", "ignore")
_config = None


def pytest_unconfigure(config) -> None:
    global _config
    _config = None


def echo_hang_diagnosis(out: str) -> Callable[[], None] | None:
    """Called by ``ddpdoctor.check()`` on entry in a pytest process. pytest captures a test's
    output, and a rank that the watchdog ends after a hang (exit 124) never gets to show it: this
    thread prints the diagnosis past the capture as soon as the kill marker appears (the rank
    lives on for a short grace). Returns the function that stops it."""
    config = _config
    if config is None or config.getoption("capture", "fd") == "no":
        return None
    stop = threading.Event()

    def run() -> None:
        marker = os.path.join(out, "HANG_KILL")
        while not stop.wait(0.1):
            if not os.path.exists(marker):
                continue
            texts = []
            for name in sorted(os.listdir(out)):
                if name.startswith("hang-") and name.endswith(".txt"):
                    try:
                        with open(os.path.join(out, name), errors="replace") as f:
                            texts.append(f.read().strip())
                    except OSError:
                        pass
            body = "\n\n".join(t for t in texts if t) or "(diagnosed and printed by another rank)"
            msg = (f"\nddpdoctor: the test hung; this rank is being ended (exit 124):\n{body}\n"
                   f"(diagnosis files in {out})\n")
            capman = config.pluginmanager.getplugin("capturemanager")
            try:
                with capman.global_and_fixture_disabled():
                    sys.stderr.write(msg)
                    sys.stderr.flush()
            except Exception:
                try:
                    os.write(2, msg.encode("utf-8", "replace"))
                except OSError:
                    pass
            return

    threading.Thread(target=run, name="ddpdoctor-hang-echo", daemon=True).start()
    return stop.set


def pytest_configure(config) -> None:
    global _config
    _config = config
    config.addinivalue_line(
        "markers",
        f"{_MARK}(hang_timeout=None, fail_on='error', select=None, ignore=None): run the test under "
        "ddpdoctor: its body inside ddpdoctor.check() when the process group exists (pytest under "
        "torchrun), else these options as defaults of its ddpdoctor.spawn() calls")


def _options(marker) -> dict:
    if marker.args:
        raise pytest.UsageError(f"@pytest.mark.{_MARK} takes keyword arguments only: "
                                + ", ".join(_OPTIONS))
    unknown = set(marker.kwargs) - set(_OPTIONS)
    if unknown:
        raise pytest.UsageError(f"@pytest.mark.{_MARK}: unknown option(s) {', '.join(sorted(unknown))}; "
                                f"known: {', '.join(_OPTIONS)}")
    return dict(marker.kwargs)


def _has_process_group() -> bool:
    dist = sys.modules.get("torch.distributed")  # never import torch just to find out
    try:
        return dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:
        return False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    marker = item.get_closest_marker(_MARK)
    if marker is None:
        return (yield)
    opts = _options(marker)
    from . import testing

    if not _has_process_group():
        with testing.spawn_defaults(**opts):
            return (yield)
    block = testing.check(**opts)
    block.__enter__()
    try:
        result = yield
    except BaseException as exc:
        # Raises DistributedBugError instead when a check explains a failed collective.
        block.__exit__(type(exc), exc, exc.__traceback__)
        raise
    block.__exit__(None, None, None)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    excinfo = call.excinfo
    testing = sys.modules.get("ddpdoctor.testing")
    if (excinfo is None or testing is None or not isinstance(excinfo.value, testing.DistributedBugError)
            or item.config.getoption("tbstyle", "auto") == "native"):
        return report
    where = ""
    for entry in reversed(excinfo.traceback):
        if str(entry.path) == str(item.path):
            where = f"{entry.path}:{entry.lineno + 1}: "
            break
    else:
        # Raised when the marker's block ended, after the test function returned: its def line.
        try:
            path, line, _name = item.reportinfo()
            where = f"{path}:{(line or 0) + 1}: " if path else ""
        except Exception:
            pass
    report.longrepr = f"{where}DistributedBugError (ddpdoctor)\n\n{excinfo.value}"
    return report

