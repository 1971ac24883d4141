"""Python / NumPy randomness drawn while the program sets up, compared across ranks (part of
unseeded-rng, DD004).

From the ``rng`` records of rank/patches/pyrng.py: a draw from the global ``random`` or
``numpy.random`` generator made before the first module forward, ``DataLoader`` iteration or
optimizer step, at the same line and occurrence on every rank, over the same input, with
different results. Set-up is where the model is built and the data is assigned, so such a draw
decides them per rank. Draws inside the loop that ends the set-up window (the training loop's
first step drawing its augmentation before the first forward) are per-step randomness, not
set-up, and are not compared; nor are values (not selections) that library code draws for itself.
"""

from __future__ import annotations

from ._records import aligned, by_value, describe, minority, site_key
from .base import Context, fmt

SELECTIONS = frozenset({"shuffle", "sample", "choice", "choices", "permutation"})
#: Selections that order or subset a collection: data assignment (error on their own).
ORDERINGS = frozenset({"shuffle", "sample", "permutation"})
_LOOPS = ("for", "while", "asyncfor")
_VERBS = {"shuffle": "shuffles the same list into a different order", "permutation": "draws a different permutation",
          "sample": "samples a different subset of the same input", "choice": "picks differently from the same options",
          "choices": "picks differently from the same options"}
_PREFIX = {"python": "random.", "numpy": "np.random."}
_SEEDER = {"python": "random.seed", "numpy": "np.random.seed"}
_GENERATOR = {"python": "Python's global generator (random)", "numpy": "NumPy's global generator (np.random)"}


def _key(v) -> object:
    """A trace value usable as a dict key (a damaged trace may hold lists)."""
    return v if v is None or isinstance(v, (int, float, str)) else repr(v)


def _ts(rec: dict) -> int:
    v = rec.get("ts", 0)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def _loops(ctx: Context, rank: int, sid) -> set[tuple]:
    """(file, line) of the loops enclosing a call site, over its whole user stack."""
    conds = ctx.site(rank, sid).get("conds") or []
    return {(c[0], c[1]) for c in conds if isinstance(c, list) and len(c) >= 4 and _key(c[3]) in _LOOPS}


def _setup_draws(ctx: Context) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r, rt in ctx.run.ranks.items():
        recs = rt.records("rng")
        end = next((x for x in recs if x.get("op") == "end"), None)
        step_loops = _loops(ctx, r, end.get("site")) if end is not None else set()
        out[r] = [x for x in recs if x.get("op") == "draw" and x.get("gen") in _PREFIX
                  and not (step_loops & _loops(ctx, r, x.get("site")))
                  # a library's own values (a port, a temporary name, a retry delay) are its business
                  and (_key(x.get("fn")) in SELECTIONS or not ctx.site(r, x.get("site")).get("via"))]
    return out


def _cause(ctx: Context, gen: str, at: dict[int, int], cited: set) -> tuple[str, list, str]:
    """How the generator was seeded on each rank before these moments: (text, locations, kind)."""
    last: dict[int, dict | None] = {}
    for r, ts in at.items():
        seeds = [s for s in ctx.run.ranks[r].records("seed")
                 if s.get("gen") == gen and _ts(s) <= ts]
        last[r] = seeds[-1] if seeds else None
    gname, seeder = _GENERATOR[gen], _SEEDER[gen]
    if all(s is None for s in last.values()):
        return (f" Cause: {gname} was never seeded ({seeder}): every process seeds it from OS entropy, "
                "so each rank draws its own values."), [], "never"
    vals = by_value({r: (_key(s.get("value")) if s else "not seeded") for r, s in last.items()})
    r0 = next(r for r, s in last.items() if s is not None)
    s0 = last[r0]
    cited.add(site_key(ctx, r0, s0.get("site")))
    loc = [ctx.loc(r0, s0.get("site"), "seed")]
    if len(vals) > 1:
        shown = describe(vals, lambda v: "OS entropy" if v is None else str(v))
        return (f" Cause: {seeder} at {ctx.where(r0, s0.get('site'))} seeds {gname} with a different value "
                f"per rank ({shown})."), loc, "rank"
    if next(iter(vals)) is None:
        return (f" Cause: {seeder}() at {ctx.where(r0, s0.get('site'))} seeds {gname} from OS entropy "
                "(no value), differently on each rank."), loc, "entropy"
    return (f" The seed ({seeder} at {ctx.where(r0, s0.get('site'))}) is the same on every rank, so the ranks "
            "drew different amounts from the generator before this line."), loc, "same"


def draw_findings(check, ctx: Context, cited: set, clean: bool) -> list:
    """Findings for set-up draws whose results differ across ranks over the same input.

    Severity: a shuffle, permutation or sample of a collection is an error (it orders or subsets
    what is assigned to the ranks); a choice is a warning and a value (a number, a pick of
    characters: a run name) info, each one step louder when something that must agree was seen to
    differ (``clean`` False: another DD004 finding, or a rank that did not exit normally)."""
    draws = _setup_draws(ctx)
    out = []
    for key, per_rank in aligned(ctx, "rng", records=lambda rt: draws[rt.rank]).items():
        if len(per_rank) < 2:
            continue
        # ranks that drew from the same input (a rank's own shard shuffled per rank is intended)
        same_in = next(iter(by_value({r: _key(d.get("in")) for r, d in per_rank.items()}).values()))
        if len(same_in) < 2:
            continue
        sub = {r: per_rank[r] for r in same_in}
        groups = by_value({r: _key(d.get("out")) for r, d in sub.items()})
        if len(groups) < 2:
            continue
        r0 = min(sub)
        d0 = sub[r0]
        gen, fn = str(d0.get("gen")), str(d0.get("fn"))
        name = _PREFIX[gen] + fn
        selection = fn in SELECTIONS and d0.get("ty") != "str"  # characters picked: a name, a value
        if selection and fn in ORDERINGS:
            sev = "error"
        elif selection:
            sev = "warning" if clean else "error"
        else:
            sev = "info" if clean else "warning"
        names = {v: f"result {chr(ord('A') + i) if i < 26 else i}" for i, v in enumerate(groups)}
        what = _VERBS.get(fn, "orders or picks from the same input differently") if selection \
            else "draws different values from the same arguments"
        msg = (f"{name} at {ctx.where(r0, d0.get('site'))} {what} on different ranks ({len(groups)} distinct "
               f"results: {describe(groups, names.get)}) while the program sets up, before its first forward, "
               f"DataLoader iteration or optimizer step. Whatever it decides there differs across ranks: "
               + ("a shuffled file or index list sharded by rank gives overlapping shards (some data seen by "
                  "several ranks, some by none), a random split differs per rank, a randomly chosen "
                  "architecture or size differs." if selection else
                  "a size, a split point or a structural choice drawn here is not the same model or data "
                  "on every rank."))
        cause, locs, seeded = _cause(ctx, gen, {r: _ts(d) for r, d in sub.items()}, cited)
        msg += cause
        out.append(check.finding(
            msg, minority(groups) if seeded == "same" else sorted(sub),
            [ctx.loc(r0, d0.get("site"), "draw"), *locs], kind="draw" if selection else "draw-value", severity=sev,
            evidence=[[fmt(rs), f"{name} -> {v}",
                       ctx.where(rs[0], sub[rs[0]].get("site"))] for v, rs in groups.items()],
            data={"what": "draw", "gen": gen, "fn": fn, "site": list(key[:2]), "seeded": seeded,
                  "distinct": len(groups)}))
    return out
