"""p2p-mismatch: a send/recv channel where the sender and the receiver disagree.

Each rank's loader keeps, per channel ``group:src>dst``, the number of messages and a running
digest of their metadata (``RankTrace.p2p``); the sender's and the receiver's entries for the
same channel must agree. Only the channels that differ are re-read, each file once, to name the
first message where they part.
"""

from __future__ import annotations

from collections import defaultdict

from ..load import iter_records
from . import _failures
from ._failures import fmt
from .base import Check, Context, Divergence


def _parse(key: str) -> tuple[str, str, str] | None:
    g, _, ch = key.rpartition(":")
    src, _, dst = ch.partition(">")
    if not g or not src or not dst:
        return None
    return g, src, dst


def _read_channels(path: str, keys: set[str], limit: int = 200000) -> dict[str, list[dict]]:
    """The p2p records of the given channels in one rank's file (one pass)."""
    out: dict[str, list[dict]] = {k: [] for k in keys}
    for rec in iter_records(path, contains=b'"p"'):  # cheap pre-filter: only p lines are parsed
        if rec.get("t") != "p":
            continue
        lst = out.get(f'{rec.get("g", "0")}:{rec.get("ch", "?")}')
        if lst is not None and len(lst) < limit:
            lst.append(rec)
    return out


def _meta(rec: dict | None) -> str:
    if rec is None:
        return "-"
    if "nobj" in rec:
        return f"{rec.get('nobj')} object(s)"
    return ",".join(map(str, rec.get("x") or [])) or "?"


def analyse(ctx: Context) -> list[dict]:
    """See _compute_channels; computed once per context."""
    return ctx.shared("analyse:p2p_mismatch", _compute_channels)


def _compute_channels(ctx: Context) -> list[dict]:
    """Mismatched channels (cached): dicts with group, src, dst, kind, counts and the records of
    the first message where sender and receiver part."""
    ranks = ctx.run.ranks
    wildcard: set[tuple[str, str]] = set()  # (group, dst) with a recv from any source
    channels: set[tuple[str, str, str]] = set()
    for rt in ranks.values():
        for key in rt.p2p:
            p = _parse(key)
            if p is None:
                continue
            if p[1] == "?":
                wildcard.add((p[0], p[2]))
            else:
                channels.add(p)
    roots = _failures.root_causes(ctx)
    bad: list[dict] = []
    for g, src, dst in sorted(channels):
        if (g, dst) in wildcard:
            continue  # a recv from any source may take these messages: compared in total below
        try:
            s, d = int(src), int(dst)
        except ValueError:
            continue
        if s not in ranks or d not in ranks:
            continue
        key = f"{g}:{src}>{dst}"
        es, er = ranks[s].p2p.get(key), ranks[d].p2p.get(key)
        ns, nr = (es[0] if es else 0), (er[0] if er else 0)
        if ns == nr and (ns == 0 or es[1] == er[1]):
            continue
        short = s if ns < nr else d if nr < ns else None
        if short is not None and short in roots:
            continue  # the side with fewer messages died: rank-failed explains it
        bad.append({"g": g, "src": s, "dst": d, "key": key, "sent": ns, "received": nr,
                    "kind": "count" if ns != nr else "meta"})
    for g, dst in sorted(wildcard):
        try:
            d = int(dst)
        except ValueError:
            continue
        if d not in ranks:
            continue
        recvd = 0
        for k, e in ranks[d].p2p.items():
            p = _parse(k)
            if p is not None and p[0] == g and p[2] == dst:
                recvd += e[0]
        sent = 0
        for r, rt in ranks.items():
            e = rt.p2p.get(f"{g}:{r}>{dst}")
            if e is not None and r != d:
                sent += e[0]
        if sent == recvd or (recvd < sent and d in roots):
            continue
        bad.append({"g": g, "src": None, "dst": d, "key": f"{g}:?>{dst}", "sent": sent,
                    "received": recvd, "kind": "count"})
    _first_difference(ctx, bad)
    return bad


def _first_difference(ctx: Context, bad: list[dict]) -> None:
    """Re-read the mismatched channels (each rank file at most once) to find the first message
    where the two sides differ."""
    wanted: dict[int, set[str]] = defaultdict(set)
    for b in bad:
        if b["src"] is None:
            continue
        wanted[b["src"]].add(b["key"])
        wanted[b["dst"]].add(b["key"])
    got = {r: _read_channels(ctx.run.ranks[r].path, keys) for r, keys in wanted.items()}
    for b in bad:
        if b["src"] is None:
            continue
        sends = [x for x in got[b["src"]].get(b["key"], []) if "send" in str(x.get("op"))]
        recvs = [x for x in got[b["dst"]].get(b["key"], []) if "recv" in str(x.get("op"))]
        n = max(len(sends), len(recvs))
        for i in range(n):
            a = sends[i] if i < len(sends) else None
            c = recvs[i] if i < len(recvs) else None
            if a is None or c is None or _meta(a) != _meta(c):
                b["index"], b["send"], b["recv"] = i + 1, a, c
                break


def explains(ctx: Context, ranks) -> bool:
    """Whether one of these ranks sits in (or failed in) a mismatched p2p channel that this
    check reports, so that a divergence where they "made no call" is explained here."""
    if not ctx.enabled(P2PMismatch.id):
        return False
    involved = set()
    for b in analyse(ctx):
        involved.add(b["dst"])
        if b["src"] is not None:
            involved.add(b["src"])
    return any(r in involved for r in ranks)


class P2PMismatch(Check):
    id = "DD011"
    category = "p2p-mismatch"
    severity = "error"
    title = "Point-to-point sends and receives do not match"
    fix = ("Pair every send with exactly one recv on the peer, in the same order, with the same shape "
           "and dtype (same count of objects for send_object_list), in the same process group; send "
           "the size first when it varies. With isend/irecv, wait() on every request.")

    def explains(self, ctx: Context, divergence: Divergence) -> bool:
        # The ranks with no call sit in a mismatched send/recv.
        return bool(divergence.stopped) and explains(ctx, divergence.stopped)

    def run(self, ctx: Context):
        findings = []
        for b in analyse(ctx):
            findings.append(self._finding(ctx, b))
        return findings

    def _finding(self, ctx: Context, b: dict):
        g, s, d = b["g"], b["src"], b["dst"]
        locs = []
        if s is None:
            msg = (f"In process group {g}, rank {d} received {b['received']} message(s) from any source, "
                   f"but the other ranks sent it {b['sent']}: "
                   + ("a receive waits forever." if b["received"] > b["sent"] else
                      "some sends are never received and block (or are lost)."))
            return self.finding(msg[:1].upper() + msg[1:], [d], [], data={k: v for k, v in b.items() if k not in ("send", "recv")})
        a, c = b.get("send"), b.get("recv")
        for r, rec in ((s, a), (d, c)):
            if rec is not None:
                locs.append(ctx.loc(r, rec.get("site")))
        i = b.get("index")
        if b["kind"] == "count":
            if b["sent"] > b["received"]:
                head = (f"rank {s} sent {b['sent']} message(s) to rank {d} in process group {g}, "
                        f"but rank {d} received only {b['received']}")
                tail = (f": send #{i} at {ctx.where(s, a.get('site'))} is never received, so it blocks "
                        f"(until the backend's timeout) or its data is lost"
                        if a is not None and i else ": sends are never received")
                if a is not None and a.get("err"):
                    tail += f"; it failed with {_failures.short_error(str(a['err']))}"
            else:
                head = (f"rank {d} posted {b['received']} receive(s) from rank {s} in process group {g}, "
                        f"but rank {s} sent only {b['sent']}")
                tail = (f": recv #{i} at {ctx.where(d, c.get('site'))} waits for a message that never comes"
                        if c is not None and i else ": a receive waits forever")
            msg = head + tail + "."
        else:
            if i:
                msg = (f"Message #{i} from rank {s} to rank {d} in process group {g} does not match: rank "
                       f"{s} sends {_meta(a)} at {ctx.where(s, a.get('site'))}, rank {d} receives into "
                       f"{_meta(c)} at {ctx.where(d, c.get('site'))}. A size mismatch aborts the "
                       "receiver or corrupts the data.")
            else:
                msg = (f"The messages from rank {s} to rank {d} in process group {g} differ in shape or "
                       "dtype between sender and receiver.")
        evidence = [[fmt([s]), f"sent {b['sent']}", _meta(a)], [fmt([d]), f"received {b['received']}",
                                                                 _meta(c)]]
        # Either side may be the wrong one (one send too many or one recv too few): both are named.
        return self.finding(msg[:1].upper() + msg[1:], [s, d], locs, evidence=evidence,
                            data={k: v for k, v in b.items() if k not in ("send", "recv")})
