"""The check ids the linter reports: the same ids and categories as the trace checks
(``ddpdoctor/analysis/checks/*.py``), kept here rather than read from the check registry:
importing the registry loads the whole offline analysis (loader, aligner, every check, the trace
contract), which costs more than importing the linter itself, for a table of twelve rows.
``tests/unit/test_lint_catalog.py`` keeps it in step with the registry (ids, categories, titles,
documentation)."""

from __future__ import annotations

from ..errors import SelectionError

#: id -> (category, title of the static finding)
CHECKS: dict[str, tuple[str, str]] = {
    "DD001": ("divergent-collectives", "Ranks issue different collectives (rank-divergent branch)"),
    "DD002": ("collective-mismatch", "Same collective, different shapes/dtypes/reduce ops/roots across ranks"),
    "DD003": ("missing-barrier", "File shared between ranks with no collective between write and use"),
    "DD004": ("unseeded-rng", "Randomness that must agree across ranks differs"),
    "DD005": ("ddp-manual-allreduce", "Gradients of a DDP model reduced again by hand"),
    "DD006": ("uneven-inputs", "Ranks run different numbers of DDP steps (uneven inputs)"),
    "DD007": ("sampler-misuse", "DistributedSampler misuse"),
    "DD008": ("rank-failed", "A rank leaves while the others go on to a collective"),
    "DD009": ("hang", "A collective waited longer than the hang timeout"),
    "DD010": ("sync-overhead", "Needless synchronisation: per-step barriers"),
    "DD011": ("p2p-mismatch", "Point-to-point sends and receives do not match"),
    "DD012": ("collective-misuse", "Collective used outside the process group's lifetime, or groups created inconsistently"),
    "DD013": ("replica-drift", "DDP replicas differ across ranks: the ranks train different models"),
    "DD014": ("batchnorm-sync", "convert_sync_batchnorm applied after DDP wrapping"),
    "DD015": ("nonfinite-gradients", "Non-finite gradients of some ranks were averaged into every DDP replica and applied"),
    "DD016": ("divergent-parameter-use", "DDP ranks gave gradients to different parameters: DDP averaged zeros from the others"),
    "DD017": ("data-coverage", "Ranks' data shards overlap or leave samples out"),
}

#: Ids whose static title differs on purpose from the trace check's: the source shows what the
#: ranks *will* do (run different step counts, leave early), and DD010 statically finds only
#: per-step barriers, not stragglers.
OWN_TITLES = frozenset({"DD006", "DD008", "DD010"})

#: Where each check's documentation lives, relative to the repository root.
DOCS_PATH = "checks/{category}/README.md"


def category(check_id: str) -> str:
    return CHECKS[check_id][0]


def title(check_id: str) -> str:
    return CHECKS[check_id][1]


def selected(select: list[str] | None, ignore: list[str] | None) -> set[str]:
    """Check ids kept by ``select`` (ids or categories; all when empty) minus ``ignore``.

    Raises SelectionError for an unknown name, so that a typo never silently turns a check off
    (the same rule as ``ddpdoctor report``)."""
    by_name = {}
    for cid, (cat, _t) in CHECKS.items():
        by_name[cid.upper()] = cid
        by_name[cat.lower()] = cid
    for name in list(select or []) + list(ignore or []):
        n = name.strip()
        if n and n.upper() not in by_name and n.lower() not in by_name:
            raise SelectionError(f"unknown check {n!r}; known: "
                                 + ", ".join(f"{c} ({cat})" for c, (cat, _t) in CHECKS.items()))

    def ids(names) -> set[str]:
        out = set()
        for n in names or []:
            n = n.strip()
            if n:
                out.add(by_name.get(n.upper()) or by_name[n.lower()])
        return out

    keep = ids(select) if select else set(CHECKS)
    return keep - ids(ignore)
