"""Which ranks to blame when ranks disagree, by comparing ranks — never "rank 0 is right".

One module for the live hang diagnosis (``verdict.hang``, in the rank's watchdog) and the offline
checks (divergent-collectives, collective-mismatch, the rare-record checks), so that the two
verdicts cannot drift apart:

1. the minority: when one side is strictly the largest, every other rank is blamed;
2. on a tie, the side whose call sits under a rank-dependent branch the others do not pass:
   where the sides' stacks parted (``verdict.parting``), judged by what the ranks did and by the
   rank-dependence analysis shared with ``ddpdoctor lint`` (``verdict.rankdep``), never by words;
3. one side still inside a loop the other has left, through a conditional exit.

A *side* is a key (an op, a value) with its ranks, represented by the ``site`` record of one of
its ranks' calls.
"""

from __future__ import annotations

from typing import Hashable, Iterator, Mapping, Sequence, TypeVar

from ..trace.sourceinfo import loop_exits
from . import parting

K = TypeVar("K", bound=Hashable)


def minority(sides: Mapping[K, Sequence[int]]) -> tuple[K, list[int]] | None:
    """``(majority key, the other ranks)`` when one side is strictly the largest, else None."""
    if len(sides) < 2:
        return None
    ordered = sorted(sides.items(), key=lambda kv: len(kv[1]), reverse=True)
    if len(ordered[0][1]) <= len(ordered[1][1]):
        return None
    major = ordered[0][0]
    return major, sorted(r for k, rs in sides.items() if k != major for r in rs)


def conditioned_side(sites: Mapping[K, Mapping | None],
                     before: Mapping[K, Mapping | None] | None = None) -> K | None:
    """The only side whose call is under a rank-dependent branch that no other side's call is
    under (``sites[side]``: the ``site`` record of one representative rank's call, None for a
    side with no call), found by comparing the sides' stacks (``verdict.parting``), or None.
    ``before[side]``: the site of that rank's previous call (see ``parting.branches``)."""
    before = before or {}
    flagged = [k for k, mine in sites.items() if mine is not None and parting.deciding(
        parting.branches(mine, [v for k2, v in sites.items() if k2 != k],
                         [v for k2, v in before.items() if k2 != k]))]
    return flagged[0] if len(flagged) == 1 else None


def left_loops(sites: Mapping[K, Mapping | None]) -> Iterator[tuple[K, K, dict, list]]:
    """``(side still in the loop, side that left it, the loop, its conditional exits)`` for every
    pair of sides where one is inside a loop of the frame where their control flow parted and
    the other is past it, with no rank-dependent branch between them inside the loop. A loop
    with conditional exits (``break``/``return`` under a condition) blames the side that left;
    without, the loop simply ran a different number of times."""
    for k, mine in sites.items():
        for k2, theirs in sites.items():
            if k2 == k or mine is None or theirs is None:
                continue
            found = parting.branches(mine, [theirs])
            if parting.deciding(found) is not None:
                continue
            loop = next((b for b in found if b.observed and b.kind in parting.LOOP_KINDS), None)
            if loop is None:
                continue
            exits = loop_exits(loop.file, loop.line)
            yield k, k2, {"file": loop.file, "line": loop.line, "text": loop.text, "exits": exits}, \
                [e for e in exits if e[2]]
