"""The house rules of the package: every check is documented and has runnable examples, module
names match check categories, no module over 600 lines, no import cycles, the Check API rejects
a malformed or duplicate check."""

from __future__ import annotations

import re

import pytest
from support.jobs import ROOT

from ddpdoctor.analysis.checks import all_checks
from ddpdoctor.analysis.checks.base import Check, CheckDefinitionError

PACKAGE = ROOT / "ddpdoctor"
MAX_LINES = 600


def test_every_check_has_its_folder_and_a_row_in_the_table():
    table = (ROOT / "checks" / "README.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (DD\d{3}) \| \[([a-z0-9-]+)\]\(", table, re.M)}
    for c in all_checks():
        folder = ROOT / "checks" / c.category
        for name in ("README.md", "bad.py", "good.py"):
            assert (folder / name).is_file(), f"{c.id}: checks/{c.category}/{name} is missing"
        assert rows.get(c.id) == c.category, f"{c.id} {c.category}: no row in checks/README.md's table"


def test_check_modules_are_named_after_their_categories():
    for c in all_checks():
        assert type(c).__module__.rsplit(".", 1)[1] == c.category.replace("-", "_"), type(c).__module__


def test_no_module_over_the_limit():
    big = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}


def test_test_file_names_are_unique():
    """tests/ has no __init__.py files: pytest imports each test file under its basename, so two
    files of one name in different folders stop the collection of the whole suite."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_no_import_cycles():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("ddpdoctor")
    # A cycle exists when some module reaches itself; check every direct import a -> b for a path b -> a.
    cycles = [(a, b) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
              if graph.find_shortest_chain(importer=b, imported=a) is not None]
    assert cycles == []


def test_a_duplicate_or_malformed_check_is_an_error_at_class_creation():
    with pytest.raises(CheckDefinitionError, match="already used"):
        type("Twin", (Check,), {"id": "DD001", "category": "twin", "title": "t", "fix": "f",
                                "run": lambda self, ctx: []})
    with pytest.raises(CheckDefinitionError, match="DDnnn"):
        type("BadId", (Check,), {"id": "X1", "category": "bad-id", "title": "t", "fix": "f",
                                 "run": lambda self, ctx: []})
    with pytest.raises(CheckDefinitionError, match="severity"):
        type("BadSeverity", (Check,), {"id": "DD998", "category": "bad-severity", "severity": "fatal",
                                       "title": "t", "fix": "f", "run": lambda self, ctx: []})


def test_a_finding_of_an_undeclared_kind_is_an_error():
    check = next(c for c in all_checks() if c.id == "DD009")
    assert check.finding("m", [0], kind="resolved").severity == "warning"
    with pytest.raises(KeyError):
        check.finding("m", [0], kind="no-such-kind")
