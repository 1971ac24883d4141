"""Command line: ``ddpdoctor trace -- CMD``, ``ddpdoctor report DIR``, ``ddpdoctor timeline DIR``,
``ddpdoctor lint PATHS`` (static; exit codes as ``report``).

Exit codes: ``report`` 0 clean, 1 findings at or above --fail-on, 2 usage/input error;
``trace`` passes the command's status through (128+N for signal N), or 124 when --on-hang kill
ended a hung job.
"""

from __future__ import annotations

import os

import click

from .errors import EXIT_HANG, EXIT_USAGE, DdpDoctorError, UsageError
from .rank import settings


class _Main(click.Group):
    """The one place where ddpdoctor's own errors become a one-line message and an exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DdpDoctorError as exc:
            _echo_error(str(exc))
            ctx.exit(EXIT_USAGE)


def _echo_error(msg: str) -> None:
    """One line, whatever the message quotes from a trace (no control characters)."""
    from .trace.safetext import for_terminal

    msg = " ".join(str(msg).split())
    click.echo(for_terminal(f"ddpdoctor: error: {msg[:2000]}"), err=True)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ddpdoctor")
def main() -> None:
    """Diagnose distributed PyTorch jobs: trace every rank, find divergence, explain hangs."""


def _print_report(paths, fmt, output, verbose, select, ignore, fail_on, run_id) -> int:
    """Analyse and print; returns the exit code. Raises DdpDoctorError for unusable input."""
    from .analysis.engine import analyze_paths

    try:
        # a typo in --select/--ignore is a usage error, not "clean"
        result = analyze_paths(list(paths), select, ignore, run_id=run_id, fail_on=fail_on)
    except OSError as exc:
        raise UsageError(f"cannot read the traces: {exc}") from None
    except DdpDoctorError:
        raise
    except Exception as exc:
        _internal_error(exc)
    run, findings, notes = result.run, result.findings, result.notes
    try:
        if fmt == "json":
            from .render.json_report import render as rj

            text = rj(run, findings, notes)
        elif fmt == "html":
            from .render.html_report import render as rh

            text = rh(run, findings, notes)
        else:
            from .render.text import render as rt

            text = rt(run, findings, notes, verbose=verbose)
    except Exception as exc:
        _internal_error(exc)
    from .trace.safetext import for_terminal, valid_unicode

    # Trace text is untrusted: no terminal control sequences, nothing that cannot be encoded.
    text = for_terminal(text) if fmt == "text" else valid_unicode(text)
    if fmt != "text" or output:
        for n in run.notes + notes:  # the text report shows them; keep machine output pure
            click.echo(for_terminal(f"ddpdoctor: note: {n}"), err=True)
    if output:
        try:
            with open(output, "w", encoding="utf-8") as f:
                f.write(text + ("\n" if not text.endswith("\n") else ""))
        except OSError as exc:
            raise UsageError(f"cannot write {output}: {exc.strerror or exc}") from None
        click.echo(f"ddpdoctor: report written to {output}", err=True)
    else:
        click.echo(text)
    return result.exit_code


def _internal_error(exc: Exception):
    """Never a traceback for a report; DDPDOCTOR_DEBUG=1 shows it."""
    if os.environ.get(settings.ENV_DEBUG):
        raise exc
    raise UsageError(f"internal error while reporting ({type(exc).__name__}: {exc}); "
                     f"set {settings.ENV_DEBUG}=1 for the traceback") from None


def _split(values) -> list[str]:
    out: list[str] = []
    for v in values or ():
        out.extend(x for x in v.split(",") if x)
    return out


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["text", "json", "html"]), default="text")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to a file.")
@click.option("-v", "--verbose", is_flag=True, help="Show per-rank evidence.")
@click.option("--select", multiple=True, help="Only these check ids or categories (comma-separated).")
@click.option("--ignore", multiple=True, help="Skip these check ids or categories.")
@click.option("--fail-on", type=click.Choice(["error", "warning", "info", "never"]), default="error",
              show_default=True, help="Exit 1 when a finding at or above this severity exists.")
@click.option("--run", "run_id", default=None, help="Run id to report when a folder holds several.")
def report(paths, fmt, output, verbose, select, ignore, fail_on, run_id):
    """Analyse trace folders (several nodes' folders may be given together)."""
    click.get_current_context().exit(
        _print_report(paths, fmt, output, verbose, _split(select), _split(ignore), fail_on, run_id))


@main.command("lint")
@click.argument("paths", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["text", "json", "sarif"]), default="text")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to a file.")
@click.option("-v", "--verbose", is_flag=True, help="Show every location of each finding.")
@click.option("--select", multiple=True, help="Only these check ids or categories (comma-separated).")
@click.option("--ignore", multiple=True, help="Skip these check ids or categories.")
@click.option("--fail-on", type=click.Choice(["error", "warning", "info", "never"]), default=None,
              help="Exit 1 when a finding at or above this severity exists (default: error).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="pyproject.toml with [tool.ddpdoctor.lint] (default: the nearest one above the first path).")
@click.option("--docs-url", default=None, help="Base URL of the check docs, for SARIF helpUri.")
def lint_cmd(paths, fmt, output, verbose, select, ignore, fail_on, config_path, docs_url):
    """Find distributed bugs in Python source without running it (files or folders)."""
    from .lint.cli import run as run_lint

    click.get_current_context().exit(
        run_lint(list(paths), fmt, output, verbose, _split(select), _split(ignore), fail_on, config_path,
                 docs_url))


@main.command(context_settings={"allow_interspersed_args": False})
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="Trace folder (default: a new one under ./ddpdoctor-traces/).")
@click.option("--hang-timeout", type=float, default=None, envvar=settings.ENV_HANG_TIMEOUT,
              help=f"Seconds a collective may wait before it is diagnosed as a hang "
                   f"(default {settings.DEFAULT_HANG_TIMEOUT:g}; 0 disables). Env: {settings.ENV_HANG_TIMEOUT}.")
@click.option("--on-hang", type=click.Choice(settings.ON_HANG_CHOICES), default="report",
              envvar=settings.ENV_ON_HANG, show_default=True,
              help="report: print the diagnosis and keep waiting; kill: end the job (exit 124).")
@click.option("--report/--no-report", "do_report", default=True, help="Print the report at the end.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def trace(out, hang_timeout, on_hang, do_report, fmt, command):
    """Run COMMAND with every rank instrumented, e.g. ddpdoctor trace -- torchrun train.py"""
    from . import launcher

    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command given: ddpdoctor trace -- COMMAND [ARGS...]")
    import shutil

    if shutil.which(command[0]) is None:  # one line, before anything is created or printed
        raise UsageError(f"command not found or not executable: {command[0]}")
    out = out or launcher.default_out_dir()
    click.echo(f"ddpdoctor: tracing into {out}", err=True)
    faults: list = []
    status, killed = launcher.run(command, out, hang_timeout, on_hang, faults=faults)  # LaunchError: usage
    gone = _output_gone(out, faults)
    if gone:
        # one warning a run: when the launcher already printed what happened, this line only
        # says what it left
        click.echo(f"ddpdoctor: {'' if faults else 'warning: '}{gone}", err=True)
    elif any(f.get("stage") == "folder" for f in faults):
        pass  # nothing was traced, as the launcher's warning said
    elif do_report:
        click.echo("", err=True)
        has_files = any(n.startswith("rank") for n in os.listdir(out)) if os.path.isdir(out) else False
        if has_files:
            try:
                _print_report([out], fmt, None, False, [], [], "never", None)
            except DdpDoctorError as exc:  # the command's exit status passes through
                click.echo(f"ddpdoctor: error: {exc}", err=True)
            except Exception as exc:  # the command's exit status must pass through regardless
                click.echo(f"ddpdoctor: error: the report failed ({type(exc).__name__}: {exc}); "
                           f"the traces are in {out}", err=True)
        else:
            click.echo(f"ddpdoctor: no rank traced: {_why_untraced(command)}", err=True)
    if killed:
        click.echo(f"ddpdoctor: the job was ended after a hang (exit {EXIT_HANG})", err=True)
        status = EXIT_HANG
    click.get_current_context().exit(status)


def _why_untraced(command: list[str]) -> str:
    """Why a run left no trace: ddpdoctor reaches Python processes through PYTHONPATH and
    sitecustomize, which python -I, -E and -S ignore."""
    for arg in command[1:]:
        if not arg.startswith("-") or arg.startswith("--"):
            break  # the script or module: the interpreter's own options are over
        if any(flag in arg[1:] for flag in "IES") and arg[1:].isalpha():
            return (f"the command runs Python with {arg}, which ignores PYTHONPATH or site "
                    f"customisation, so ddpdoctor was not loaded; the run was not traced")
    return "the command never initialised a process group (or its Python processes ignore PYTHONPATH)"


def _output_gone(out: str, faults: list) -> str | None:
    """Why nothing of the run can be reported (the folder vanished, was never writable, or no
    rank could create its trace), or None. Said instead of "no rank traced", which would be
    false."""
    if any(f.get("stage") == "folder" for f in faults):
        return None
    if not os.path.isdir(out):
        return (f"the trace folder {out} was removed or replaced during the run; no trace was kept "
                f"(the command's own output and exit status are unaffected)")

    def kept(name: str) -> bool:
        try:
            return os.path.getsize(os.path.join(out, name)) > 0
        except OSError:
            return False

    has_files = any(n.startswith("rank") and n.endswith(".jsonl") and kept(n) for n in os.listdir(out))
    if faults and not has_files:
        from .trace.ranges import fmt_ranks

        ranks = fmt_ranks(sorted({f.get("rank") for f in faults if isinstance(f.get("rank"), int)}))
        return (f"no trace was kept: rank(s) {ranks} could not write their trace in {out} "
                f"({faults[0].get('why')}); the command's own output and exit status are unaffected")
    return None


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="ddpdoctor-timeline.json",
              show_default=True)
@click.option("--ranks", default=None, help="Only these ranks, e.g. 0-3,8.")
@click.option("--window", default=None, help="Only this time window in seconds, e.g. 10:20.")
def timeline(paths, output, ranks, window):
    """Write a Chrome Trace Event / Perfetto timeline of the run."""
    from .render import timeline as tl

    try:
        n = tl.write(list(paths), output, ranks=ranks, window=window)
    except ValueError as exc:  # a bad --ranks/--window (TraceError is a DdpDoctorError)
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot write {output}: {exc.strerror or exc}") from None
    except DdpDoctorError:
        raise
    except Exception as exc:  # never a traceback; DDPDOCTOR_DEBUG=1 shows it
        if os.environ.get(settings.ENV_DEBUG):
            raise
        raise UsageError(f"internal error while writing the timeline ({type(exc).__name__}: {exc}); "
                         f"set {settings.ENV_DEBUG}=1 for the traceback") from None
    click.echo(f"ddpdoctor: {n} events written to {output} (open in https://ui.perfetto.dev)", err=True)


if __name__ == "__main__":
    main()
