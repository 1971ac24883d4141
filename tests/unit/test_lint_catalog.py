"""The linter's copy of the check catalog (ddpdoctor/lint/catalog.py) is in step with the trace
checks' registry: same ids, categories, titles (but for the few worded for the source on
purpose) and documentation pages. The copy exists so that the linter does not import the whole
offline analysis; this test is what keeps it honest."""

from __future__ import annotations

from support.jobs import ROOT

from ddpdoctor.analysis.checks import all_checks
from ddpdoctor.lint import catalog


def test_ids_and_categories_match_the_registry():
    registry = {c.id: c.category for c in all_checks()}
    assert {cid: cat for cid, (cat, _t) in catalog.CHECKS.items()} == registry


def test_titles_match_the_registry_except_the_declared_static_wordings():
    for c in all_checks():
        static = catalog.title(c.id)
        if c.id in catalog.OWN_TITLES:
            assert static != c.title, f"{c.id}: same title as the check; drop it from OWN_TITLES"
        else:
            assert static == c.title, f"{c.id}: the linter says {static!r}, the check {c.title!r}"
    assert catalog.OWN_TITLES <= set(catalog.CHECKS)


def test_docs_paths_are_the_checks_pages():
    for c in all_checks():
        path = catalog.DOCS_PATH.format(category=catalog.category(c.id))
        assert path == f"checks/{c.category}/README.md"
        assert (ROOT / path).is_file(), path
