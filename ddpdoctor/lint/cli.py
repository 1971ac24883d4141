"""The ``ddpdoctor lint`` command's body (the click declaration lives in ddpdoctor/cli.py).

Unusable input (a bad setting, an unknown check, no file to lint, an output that cannot be
written) raises a :class:`ddpdoctor.errors.DdpDoctorError`; the command line's one handler turns
it into one line and ``EXIT_USAGE``."""

from __future__ import annotations

import os

import click

from ..analysis.findings import SEVERITY_RANK
from ..errors import EXIT_FINDINGS, EXIT_OK, DdpDoctorError, UsageError
from .config import find_pyproject, load_config
from .engine import lint
from .output import render_json, render_text
from .sarif import render as render_sarif


def _note(msg: str) -> None:
    click.echo(f"ddpdoctor: {msg}", err=True)


def exit_code(findings, fail_on: str) -> int:
    """EXIT_FINDINGS when a finding is at least as severe as ``fail_on`` (error|warning|info),
    else EXIT_OK."""
    if fail_on == "never":
        return EXIT_OK
    limit = SEVERITY_RANK[fail_on]
    return EXIT_FINDINGS if any(SEVERITY_RANK.get(f.severity, 9) <= limit for f in findings) else EXIT_OK


def run(paths: list[str], fmt: str, output: str | None, verbose: bool, select: list[str], ignore: list[str],
        fail_on: str | None, config_path: str | None, docs_url: str | None) -> int:
    """Lint and print; returns the exit code. Raises DdpDoctorError (ConfigError, SelectionError,
    UsageError) for unusable input."""
    cfg = load_config(config_path if config_path else find_pyproject(paths[0] if paths else "."))
    try:
        result = lint(paths, cfg, select or None, ignore or None)
    except DdpDoctorError:  # an unknown check name: the command line's handler reports it
        raise
    except Exception as exc:  # never a traceback; DDPDOCTOR_DEBUG=1 shows it
        if os.environ.get("DDPDOCTOR_DEBUG"):
            raise
        raise UsageError(f"internal error while linting ({type(exc).__name__}: {exc}); "
                         f"set DDPDOCTOR_DEBUG=1 for the traceback") from None
    if not result.files:
        for n in result.notes:
            _note(f"note: {n}")
        raise UsageError("no Python files to lint in " + " ".join(paths))
    if fmt == "json":
        text = render_json(result)
    elif fmt == "sarif":
        text = render_sarif(result, docs_url or cfg.docs_url)
    else:
        text = render_text(result, verbose)
    if fmt != "text" or output:
        for n in result.notes:  # keep machine output pure
            _note(f"note: {n}")
    if output:
        try:
            with open(output, "w", encoding="utf-8") as f:
                f.write(text if text.endswith("\n") else text + "\n")
        except OSError as exc:
            raise UsageError(f"cannot write {output}: {exc.strerror or exc}") from None
        _note(f"lint results written to {output} ({len(result.findings)} finding(s))")
    else:
        click.echo(text)
    return exit_code(result.findings, fail_on or cfg.fail_on or "error")
