"""ddpdoctor's exceptions and exit codes, in one place.

Every error ddpdoctor raises on purpose is a :class:`DdpDoctorError`; its ``slug`` names the
documentation page that explains it. The command line turns one into a one-line message and
:data:`EXIT_USAGE`; nothing below the command line calls ``sys.exit`` itself.

Imports nothing: the rank side, the analysis side and the interfaces all use it.
"""

from __future__ import annotations

from typing import Sequence

#: ``ddpdoctor report``: no finding at or above --fail-on.
EXIT_OK = 0
#: ``ddpdoctor report``: findings at or above --fail-on.
EXIT_FINDINGS = 1
#: Usage or input error (a missing folder, an unknown check, a command that cannot start).
EXIT_USAGE = 2
#: ``--on-hang kill`` ended a hung job (the ranks end themselves with it, the launcher passes it on).
EXIT_HANG = 124


class DdpDoctorError(Exception):
    """Base of ddpdoctor's own errors. ``slug``: the page that explains it (relative to the
    repository root)."""

    slug = "README.md"

    @property
    def docs(self) -> str:
        return self.slug


class TraceError(DdpDoctorError):
    """A problem with the input that the user must fix (a missing or empty folder)."""

    slug = "docs/trace-format.md"


class SelectionError(DdpDoctorError, ValueError):
    """--select/--ignore named a check that does not exist."""

    slug = "checks/README.md"


class LaunchError(DdpDoctorError):
    """The traced command could not be started."""

    slug = "README.md#ddpdoctor-trace----command-zero-code-change-any-launcher"


class UsageError(DdpDoctorError):
    """A command-line argument ddpdoctor cannot use (an empty command, a bad filter)."""


class DistributedBugError(DdpDoctorError):
    """A distributed bug found by ddpdoctor.

    ``str(err)`` is the rendered report (ranks, source lines, fix); ``findings`` is the list of
    :class:`ddpdoctor.analysis.findings.Finding` behind it (empty for a hang or rank failure that
    no check explains); ``hang`` is the watchdog's diagnosis text when the job hung;
    ``rank_errors`` maps a failed rank to its exception and traceback text (``spawn``);
    ``trace_dir`` is a folder holding the traces (``ddpdoctor report DIR`` renders them again).
    """

    slug = "docs/testing.md"

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
