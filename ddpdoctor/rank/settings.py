"""Environment variables that configure ddpdoctor in traced processes, read in one place.

``ddpdoctor trace`` sets these for the command it runs; every process of the job inherits them
(launchers pass their environment on), which is how instrumentation reaches every rank without
touching the command line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: Folder where each rank writes its trace file. Instrumentation is active only where it is set.
ENV_OUT = "DDPDOCTOR_OUT"
#: Identifier shared by all processes of one traced run (one ``ddpdoctor trace`` invocation).
ENV_RUN_ID = "DDPDOCTOR_RUN_ID"
#: Seconds a collective may stay pending before it is diagnosed as a hang (0 disables).
ENV_HANG_TIMEOUT = "DDPDOCTOR_HANG_TIMEOUT"
#: What to do on a hang: ``report`` (keep waiting) or ``kill`` (end the job).
ENV_ON_HANG = "DDPDOCTOR_ON_HANG"
#: Directory of the ddpdoctor package's parent, so children with another sys.path can import it.
ENV_HOME = "DDPDOCTOR_HOME"
#: Set to 1 to print ddpdoctor's internal errors with tracebacks (they are otherwise logged once).
ENV_DEBUG = "DDPDOCTOR_DEBUG"
#: Set to 0 to switch off file-operation recording (the missing-barrier check's input).
ENV_FILES = "DDPDOCTOR_FILES"

DEFAULT_HANG_TIMEOUT = 60.0
ON_HANG_CHOICES = ("report", "kill")


@dataclass(frozen=True)
class Settings:
    out: str | None
    run_id: str
    hang_timeout: float
    on_hang: str
    debug: bool
    record_files: bool


def _float(value: str | None, default: float) -> float:
    try:
        return float(value) if value not in (None, "") else default
    except ValueError:
        return default


def from_env(environ: dict[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    on_hang = env.get(ENV_ON_HANG, "report")
    return Settings(
        out=env.get(ENV_OUT) or None,
        run_id=env.get(ENV_RUN_ID, ""),
        hang_timeout=_float(env.get(ENV_HANG_TIMEOUT), DEFAULT_HANG_TIMEOUT),
        on_hang=on_hang if on_hang in ON_HANG_CHOICES else "report",
        debug=env.get(ENV_DEBUG, "") not in ("", "0"),
        record_files=env.get(ENV_FILES, "1") != "0",
    )
