"""SARIF 2.1.0 output (GitHub code scanning and other code-scanning UIs).

One rule per check id (DD001..DD012) with its title, default level and documentation; one result
per finding with its file, line, message, related locations (the condition, the write, ...) and
a stable ``partialFingerprints["ddpdoctor/v1"]``: a hash of the check id, the file's path and the
stripped text of the finding's lines, so that it survives code moving up or down the file.

``helpUri``: the documentation lives in the repository (``checks/<category>/README.md``) and has
no public URL yet, and SARIF requires an absolute URI there; so ``helpUri`` is written only when
a base URL is configured (``--docs-url`` or ``docs-url`` in ``[tool.ddpdoctor.lint]``), and every
rule always carries the relative path in ``help`` and ``properties.docs``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from . import catalog
from .engine import LintResult
from .output import tool_version

SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
LEVEL = {"error": "error", "warning": "warning", "info": "note"}
DEFAULT_LEVEL = {"DD010": "note"}


def _uri(path: str, root: str) -> tuple[str, str | None]:
    ap = os.path.abspath(path)
    rel = os.path.relpath(ap, root)
    if not rel.startswith(".."):
        return Path(rel).as_posix(), "%SRCROOT%"
    return Path(ap).as_uri(), None


def _loc(path: str, line: int, root: str) -> dict:
    uri, base = _uri(path, root)
    art = {"uri": uri}
    if base:
        art["uriBaseId"] = base
    return {"physicalLocation": {"artifactLocation": art, "region": {"startLine": max(1, int(line))}}}


def rules(docs_url: str | None = None) -> list[dict]:
    out = []
    for cid, (cat, title) in catalog.CHECKS.items():
        docs = catalog.DOCS_PATH.format(category=cat)
        rule = {
            "id": cid,
            "name": "".join(w.capitalize() for w in cat.split("-")),
            "shortDescription": {"text": title},
            "help": {"text": f"{cid} {cat}: see {docs} in the ddpdoctor repository.",
                     "markdown": f"**{cid} `{cat}`** — {title}. Documentation: [{docs}]({docs})."},
            "defaultConfiguration": {"level": DEFAULT_LEVEL.get(cid, "error")},
            "properties": {"category": cat, "docs": docs, "tags": ["distributed", "pytorch", cat]},
        }
        if docs_url:
            rule["helpUri"] = docs_url.rstrip("/") + "/" + docs
        out.append(rule)
    return out


def fingerprint(check_id: str, uri: str, texts: list[str], occurrence: int) -> str:
    h = hashlib.sha256()
    for part in [check_id, uri, *[" ".join(t.split()) for t in texts], str(occurrence)]:
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:32]


def document(result: LintResult, docs_url: str | None = None, root: str | None = None) -> dict:
    root = os.path.abspath(root or os.getcwd())
    rule_list = rules(docs_url)
    index = {r["id"]: i for i, r in enumerate(rule_list)}
    results = []
    seen: dict[str, int] = {}
    for f in result.findings:
        if not f.locations:
            continue
        p = f.locations[0]
        uri, _b = _uri(p.file, root)
        base = fingerprint(f.id, uri, [loc.source for loc in f.locations], 0)
        n = seen.get(base, 0)
        seen[base] = n + 1
        res = {
            "ruleId": f.id,
            "ruleIndex": index[f.id],
            "level": LEVEL.get(f.severity, "warning"),
            "message": {"text": f.message + (f" Fix: {f.fix}" if f.fix else "")},
            "locations": [_loc(p.file, p.line, root)],
            "partialFingerprints": {"ddpdoctor/v1": fingerprint(f.id, uri, [loc.source for loc in f.locations], n)},
            "properties": {"source": "static", "category": f.category, "title": f.title},
        }
        related = []
        for i, loc in enumerate(f.locations[1:], 1):
            r = _loc(loc.file, loc.line, root)
            r["id"] = i
            r["message"] = {"text": f"{loc.role}: {loc.source}" if loc.source else loc.role}
            related.append(r)
        if related:
            res["relatedLocations"] = related
        results.append(res)
    driver = {"name": "ddpdoctor", "version": tool_version(), "rules": rule_list}
    if docs_url:
        driver["informationUri"] = docs_url
    run = {
        "tool": {"driver": driver},
        "originalUriBaseIds": {"%SRCROOT%": {"uri": Path(root).as_uri() + "/"}},
        "results": results,
        "columnKind": "unicodeCodePoints",
        "invocations": [{
            "executionSuccessful": True,
            "toolExecutionNotifications": [{"message": {"text": n}, "level": "warning"} for n in result.notes],
        }],
    }
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}


def render(result: LintResult, docs_url: str | None = None) -> str:
    return json.dumps(document(result, docs_url), indent=2)
