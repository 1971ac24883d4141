"""Running the linter: files -> program -> rules -> suppressed, selected, sorted findings."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field

from ..analysis.findings import SEVERITY_RANK, Finding
from ..source.program import Program
from ..source.units import Module
from . import catalog
from .comm import CommModel
from .config import LintConfig, discover
from .rules import Rules
from .structure import Structure
from .suppress import comments, suppressed


@dataclass
class LintResult:
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    lines: int = 0
    suppressed: int = 0
    seconds: float = 0.0


def _read(path: str) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    return raw.decode("utf-8-sig")


def load_modules(files: list[str], notes: list[str]) -> list[Module]:
    """Parse every file; one that cannot be read or parsed gets a note and is left out."""
    out = []
    for p in files:
        try:
            src = _read(p)
        except OSError as exc:
            notes.append(f"{p}: cannot read ({exc.strerror or exc}); skipped")
            continue
        except UnicodeDecodeError:
            notes.append(f"{p}: not UTF-8 text; skipped")
            continue
        try:
            out.append(Module(p, src, display=os.path.relpath(p) if not os.path.isabs(p) else p))
        except SyntaxError as exc:
            notes.append(f"{p}:{exc.lineno or 0}: does not parse ({exc.msg}); skipped")
        except (ValueError, RecursionError) as exc:
            notes.append(f"{p}: cannot be analysed ({type(exc).__name__}); skipped")
    return out


def lint_modules(modules: list[Module], config: LintConfig | None = None,
                 enabled: set[str] | None = None) -> tuple[list[Finding], list[str], int]:
    """Findings of the selected checks over parsed modules, plus notes and the suppressed count."""
    config = config or LintConfig()
    enabled = set(catalog.CHECKS) if enabled is None else enabled
    notes: list[str] = []
    prog = Program(modules, extra_names=config.rank_names, comm_names=config.communicating_functions)
    cm = CommModel(prog)
    found: list[Finding] = []
    try:
        found += Structure(prog, cm).run()
    except Exception as exc:  # one broken rule must not hide the others' findings
        if os.environ.get("DDPDOCTOR_DEBUG"):
            raise
        notes.append(f"the structural rule failed: {type(exc).__name__}: {exc}")
    try:
        found += Rules(prog, cm).run(enabled)
    except Exception as exc:
        if os.environ.get("DDPDOCTOR_DEBUG"):
            raise
        notes.append(f"a rule failed: {type(exc).__name__}: {exc}")
    notes.extend(prog.notes)
    by_display = {m.display: m for m in modules}
    tables = {}
    out: list[Finding] = []
    seen = set()
    n_suppressed = 0
    for f in found:
        if f.id not in enabled:
            continue
        primary = f.locations[0] if f.locations else None
        key = (f.id, primary.file if primary else "", primary.line if primary else 0)
        if key in seen:
            continue
        seen.add(key)
        m = by_display.get(primary.file) if primary else None
        if m is not None:
            if m.display not in tables:
                tables[m.display] = comments(m.source)
            lines = [loc.line for loc in f.locations if loc.file == m.display]
            if suppressed(tables[m.display], lines, f.id, f.category):
                n_suppressed += 1
                continue
        out.append(f)
    out.sort(key=sort_key)
    return out, notes, n_suppressed


def sort_key(f: Finding):
    p = f.locations[0] if f.locations else None
    return (SEVERITY_RANK.get(f.severity, 9), p.file if p else "", p.line if p else 0, f.id)


def lint(paths: list[str], config: LintConfig | None = None, select: list[str] | None = None,
         ignore: list[str] | None = None) -> LintResult:
    """Lint files and folders. Raises ddpdoctor.errors.SelectionError for an unknown check name."""
    config = config or LintConfig()
    enabled = catalog.selected(select if select else config.select, ignore if ignore else config.ignore)
    t0 = time.perf_counter()
    # The syntax trees are large graphs of small objects that live until the end: the cyclic
    # garbage collector would scan them again and again (half the run time). Paused meanwhile.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        files, notes = discover(paths, config.exclude)
        notes = list(config.notes) + notes
        modules = load_modules(files, notes)
        findings, more, n_sup = lint_modules(modules, config, enabled)
        lines = sum(len(m.lines) for m in modules)
    finally:
        if was_enabled:
            gc.enable()
    return LintResult(findings, notes + more, files, lines, n_sup, time.perf_counter() - t0)
