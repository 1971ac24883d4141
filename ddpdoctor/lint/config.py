"""Settings from ``[tool.ddpdoctor.lint]`` of the nearest pyproject.toml, and the files to lint.

Keys (all optional)::

    [tool.ddpdoctor.lint]
    rank-names = ["my_rank", "is_leader"]      # extra names/attributes/functions that hold a rank
    communicating-functions = ["sync_metrics"] # user or library functions that communicate
    exclude = ["build/*", "*/third_party/*"]   # fnmatch patterns of paths to skip
    select = ["DD001", "missing-barrier"]
    ignore = ["DD010"]
    fail-on = "error"
    docs-url = "https://github.com/ORG/ddpdoctor/blob/main/"   # base of SARIF helpUri

TOML is read with ``tomllib`` (Python 3.11+); on older Pythons a pyproject with this table gets
a one-line note and the defaults.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field

from ..errors import UsageError

SKIP_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".tox", ".nox", "node_modules",
                       ".mypy_cache", ".pytest_cache", ".ruff_cache", "build", "dist", ".eggs", "site-packages"})


class ConfigError(UsageError, ValueError):
    """The settings table cannot be read, has a wrong type or an unknown key."""

    slug = "docs/lint.md"


@dataclass
class LintConfig:
    rank_names: list[str] = field(default_factory=list)
    communicating_functions: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    select: list[str] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    fail_on: str | None = None
    docs_url: str | None = None
    source: str | None = None  # the pyproject it came from
    notes: list[str] = field(default_factory=list)


_KEYS = {"rank-names": "rank_names", "communicating-functions": "communicating_functions",
         "exclude": "exclude", "select": "select", "ignore": "ignore", "fail-on": "fail_on", "docs-url": "docs_url"}


def find_pyproject(start: str) -> str | None:
    d = os.path.abspath(start if os.path.isdir(start) else os.path.dirname(start) or ".")
    while True:
        p = os.path.join(d, "pyproject.toml")
        if os.path.isfile(p):
            return p
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def load_config(path: str | None) -> LintConfig:
    """The settings of a pyproject.toml (defaults when None or without the table)."""
    cfg = LintConfig()
    if path is None:
        return cfg
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        import tomllib
    except ImportError:  # Python < 3.11: no TOML reader in the standard library
        if b"[tool.ddpdoctor.lint]" in raw:
            cfg.notes.append(f"{path}: [tool.ddpdoctor.lint] ignored (reading TOML needs Python 3.11+)")
        return cfg
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    table = doc.get("tool", {}).get("ddpdoctor", {}).get("lint")
    if table is None:
        return cfg
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.ddpdoctor.lint] must be a table")
    cfg.source = path
    for k, v in table.items():
        attr = _KEYS.get(k) or _KEYS.get(k.replace("_", "-"))
        if attr is None:
            raise ConfigError(f"{path}: unknown key {k!r} in [tool.ddpdoctor.lint] (known: {', '.join(_KEYS)})")
        if attr in ("fail_on", "docs_url"):
            if not isinstance(v, str):
                raise ConfigError(f"{path}: {k} must be a string")
            if attr == "fail_on" and v not in ("error", "warning", "info", "never"):
                raise ConfigError(f"{path}: fail-on must be error, warning, info or never")
        elif not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise ConfigError(f"{path}: {k} must be a list of strings")
        setattr(cfg, attr, v)
    return cfg


def discover(paths: list[str], exclude: list[str]) -> tuple[list[str], list[str]]:
    """Python files under ``paths`` (files are taken as given), sorted; plus notes for paths that
    do not exist."""
    files: list[str] = []
    notes: list[str] = []

    def excluded(p: str) -> bool:
        rel = os.path.relpath(p)
        return any(fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(p, pat) for pat in exclude)

    for p in paths:
        if os.path.isfile(p):
            if not excluded(p):
                files.append(p)
        elif os.path.isdir(p):
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")
                                 and not excluded(os.path.join(root, d)))
                for n in sorted(names):
                    if n.endswith(".py"):
                        fp = os.path.join(root, n)
                        if not excluded(fp):
                            files.append(fp)
        else:
            notes.append(f"{p}: no such file or folder")
    seen, out = set(), []
    for f in files:
        k = os.path.abspath(f)
        if k not in seen:
            seen.add(k)
            out.append(f)
    return out, notes
