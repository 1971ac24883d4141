"""Which ranks to blame when ranks disagree, by comparing ranks — never "rank 0 is right".

One module for the live hang diagnosis (``verdict.hang``, in the rank's watchdog) and the offline
checks (divergent-collectives, collective-mismatch, the rare-record checks), so that the two
verdicts cannot drift apart:

1. the minority: when one side is strictly the largest, every other rank is blamed;
2. on a tie, the side whose call sits under a rank-dependent condition the others do not pass;
3. one side still inside a loop the other has left (``loop_left``), through a conditional exit.

A *side* is a key (an op, a value) with its ranks; its *conditions* are the enclosing branch headers
of its call site (``[file, line, text, kind]``, recorded with every site).
"""

from __future__ import annotations

from typing import Hashable, Iterator, Mapping, Sequence, TypeVar

from ..trace.sourceinfo import is_rank_dependent, loop_left

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


def split_conditions(mine: Sequence, others: Sequence[Sequence]) -> list:
    """The branch headers enclosing my call that none of the others' calls is under."""
    theirs = {(c[0], c[1]) for conds in others for c in conds}
    return [c for c in mine if (c[0], c[1]) not in theirs]


def conditioned_side(conds: Mapping[K, Sequence]) -> K | None:
    """The only side whose call is under a rank-dependent condition that no other side's call is
    under (``conds[side]``: the conditions of one representative rank's call), or None."""
    flagged = [k for k, mine in conds.items()
               if any(is_rank_dependent(str(c[2]))
                      for c in split_conditions(mine, [v for k2, v in conds.items() if k2 != k]))]
    return flagged[0] if len(flagged) == 1 else None


def left_loops(conds: Mapping[K, Sequence]) -> Iterator[tuple[K, K, dict, list]]:
    """``(side still in the loop, side that left it, the loop, its conditional exits)`` for every
    pair of sides where one has left a loop the other is still in (see ``sourceinfo.loop_left``).
    A loop with conditional exits (``break``/``return`` under a condition on a rank-local value)
    blames the side that left; without, the loop simply ran a different number of times."""
    for k, mine in conds.items():
        for k2, theirs in conds.items():
            if k2 == k:
                continue
            found = loop_left(mine, theirs)
            if found is not None:
                yield k, k2, found, [e for e in found["exits"] if e[2]]
