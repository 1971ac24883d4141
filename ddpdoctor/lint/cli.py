"""The ``ddpdoctor lint`` command's body (the click declaration lives in ddpdoctor/cli.py)."""

from __future__ import annotations

import os
import sys

from ..analysis.findings import SEVERITY_RANK

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


def _err(msg: str) -> None:
    print(f"ddpdoctor: {msg}", file=sys.stderr)


def exit_code(findings, fail_on: str) -> int:
    """1 when a finding is at least as severe as ``fail_on`` (error|warning|info), else 0."""
    if fail_on == "never":
        return EXIT_OK
    limit = SEVERITY_RANK[fail_on]
    return EXIT_FINDINGS if any(SEVERITY_RANK.get(f.severity, 9) <= limit for f in findings) else EXIT_OK


def run(paths: list[str], fmt: str, output: str | None, verbose: bool, select: list[str], ignore: list[str],
        fail_on: str | None, config_path: str | None, docs_url: str | None) -> int:
    from . import catalog
    from .config import ConfigError, find_pyproject, load_config
    from .engine import lint

    try:
        cfg = load_config(config_path if config_path else find_pyproject(paths[0] if paths else "."))
    except ConfigError as exc:
        _err(f"error: {exc}")
        return EXIT_USAGE
    try:
        result = lint(paths, cfg, select or None, ignore or None)
    except catalog.SelectionError as exc:
        _err(f"error: {exc}")
        return EXIT_USAGE
    except Exception as exc:  # never a traceback; DDPDOCTOR_DEBUG=1 shows it
        if os.environ.get("DDPDOCTOR_DEBUG"):
            raise
        _err(f"error: internal error while linting ({type(exc).__name__}: {exc}); "
             f"set DDPDOCTOR_DEBUG=1 for the traceback")
        return EXIT_USAGE
    if not result.files:
        for n in result.notes:
            _err(f"note: {n}")
        _err("error: no Python files to lint in " + " ".join(paths))
        return EXIT_USAGE
    if fmt == "json":
        from .output import render_json

        text = render_json(result)
    elif fmt == "sarif":
        from .sarif import render

        text = render(result, docs_url or cfg.docs_url)
    else:
        from .output import render_text

        text = render_text(result, verbose)
    if fmt != "text" or output:
        for n in result.notes:  # keep machine output pure
            _err(f"note: {n}")
    if output:
        try:
            with open(output, "w", encoding="utf-8") as f:
                f.write(text if text.endswith("\n") else text + "\n")
        except OSError as exc:
            _err(f"error: cannot write {output}: {exc.strerror or exc}")
            return EXIT_USAGE
        _err(f"lint results written to {output} ({len(result.findings)} finding(s))")
    else:
        print(text)
    return exit_code(result.findings, fail_on or cfg.fail_on or "error")
