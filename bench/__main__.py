"""``python -m bench``: run the benchmark suite, print one table, write JSON and markdown.

    python -m bench                      # everything (about 10-15 minutes on 2 cores)
    python -m bench --quick              # smaller counts, fewer repetitions (a few minutes)
    python -m bench --only overhead,hang # a subset: overhead train hang report size lint fr instructions (or 1-8)

See bench/README.md for what each figure means and its target.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from tabulate import tabulate

from . import fr_scale, hang, instructions, lint_speed, overhead, scale
from .common import BENCH, Row, loadavg, machine

FIGURES = {"1": "overhead", "2": "train", "3": "hang", "4": "report", "5": "size", "6": "lint", "7": "fr",
           "8": "instructions"}
NAMES = set(FIGURES.values())


def _parse_only(text: str | None) -> set[str]:
    if not text:
        return set(NAMES)
    out = set()
    for part in text.split(","):
        part = part.strip()
        name = FIGURES.get(part, part)
        if name not in NAMES:
            raise SystemExit(f"--only: unknown figure {part!r} (choose from {', '.join(sorted(NAMES))} or 1-6)")
        out.add(name)
    return out


def _markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [
        "# ddpdoctor benchmark results",
        "",
        f"`{doc['command']}` — {doc['started']}, {doc['duration_s'] / 60:.1f} min"
        + (" (**--quick**: reduced counts, not the reference figures)" if doc["quick"] else ""),
        "",
        f"Machine: {m['cores']} cores, {m['cpu']}, {m['memory_gb']} GB, {m['os']}, Python {m['python']}, "
        f"torch {m['torch']}. Load average (1 min) during the run: {doc['loadavg_min']}-{doc['loadavg_max']}"
        + (" — **a loaded machine** (other jobs were running)" if doc["loaded"] else "") + ".",
        "",
        "| fig | measurement | result | target | ok | notes |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["figures"]:
        ok = {True: "yes", False: "**no**", None: "—"}[r["ok"]]
        notes = r["notes"].replace("|", "\\|")
        lines.append(f"| {r['figure']} | {r['what']} | {r['result']} | {r['target']} | {ok} | {notes} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced counts and repetitions")
    ap.add_argument("--only", help="comma-separated subset: overhead, train, hang, report, size, lint, fr, "
                                         "instructions (or 1-8)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of the overhead runs (default 3; quick 2)")
    ap.add_argument("--hang-reps", type=int, default=None, help="repetitions per hang size (default 2; quick 1)")
    ap.add_argument("--json", default=None, help="where to write the JSON (default bench/results.json, "
                                                 "bench/results-quick.json with --quick)")
    ap.add_argument("--markdown", default=None, help="where to write the markdown (default bench/RESULTS.md, "
                                                     "bench/RESULTS-quick.md with --quick)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when any target is missed")
    ap.add_argument("--instr-watchdog", action="store_true",
                    help="fig. 6: count with the hang watchdog on (a per-second cost; see bench/instructions.py)")
    args = ap.parse_args(argv)
    only = _parse_only(args.only)
    reps = args.reps or (2 if args.quick else 3)
    hang_reps = args.hang_reps or (1 if args.quick else 2)
    suffix = "-quick" if args.quick else ""
    json_path = args.json or str(BENCH / f"results{suffix}.json")
    md_path = args.markdown or str(BENCH / f"RESULTS{suffix}.md")

    mach = machine()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(f"ddpdoctor benchmarks{' (--quick)' if args.quick else ''}: {mach['cores']} cores, {mach['cpu']}, "
          f"torch {mach['torch']}, Python {mach['python']}; load average {loadavg()}", flush=True)
    t0 = time.monotonic()
    rows: list[Row] = []
    raw: dict = {}
    loads = [loadavg()]

    def log(msg: str) -> None:
        print(msg, flush=True)

    workloads = []
    if "overhead" in only:
        workloads += list(overhead.COLLECTIVES)
    if only & {"train", "size"}:
        workloads.append("train")
    if workloads:
        modes = overhead.MODES if only & {"overhead", "train"} else ("ddpdoctor",)
        log(f"[1,2,5] recording overhead: {', '.join(workloads)}; {reps} repetition(s) of "
            f"{' / '.join(modes)}, interleaved")
        r, raw["overhead"] = overhead.run(workloads, args.quick, reps if len(modes) > 1 else 1, modes, log)
        if "train" not in only and "size" in only:
            r = [x for x in r if x.figure == "5"]
        elif "size" not in only:
            r = [x for x in r if x.figure != "5"]
        rows += r
        loads += raw["overhead"]["loadavg"]
    if "hang" in only:
        sizes = [2, 4] if args.quick else [2, 8, 16]
        log(f"[3] hang detection latency: {', '.join(map(str, sizes))} ranks, {hang_reps} repetition(s) each")
        r, raw["hang"] = hang.run(sizes, hang_reps, log=log)
        rows += r
        loads += [c["loadavg"] for c in raw["hang"]["cases"]]
    if "report" in only:
        log("[4] report scale on synthetic traces")
        r, raw["report"] = scale.run(args.quick, log=log)
        rows += r
        loads += [x["loadavg"] for x in raw["report"]["results"]]
    if "lint" in only:
        log("[6] static linter speed")
        r, raw["lint"] = lint_speed.run(args.quick, log=log)
        rows += r
        loads += [x["loadavg"] for x in raw["lint"]["runs"]]
    if "fr" in only:
        log("[7] Flight Recorder dumps at scale (synthetic, 2000 entries per rank)")
        r, raw["fr"] = fr_scale.run(args.quick, log=log)
        rows += r
        loads += [x["loadavg"] for x in raw["fr"]["results"]]
    if "instructions" in only:
        log("[8] instructions and syscalls per call (callgrind, strace), plain vs ddpdoctor")
        r, raw["instructions"] = instructions.run(args.quick, log=log, watchdog=args.instr_watchdog)
        rows += r
    loads.append(loadavg())
    duration = time.monotonic() - t0
    rows.sort(key=lambda x: x.figure)
    cores = mach["cores"] or 1
    doc = {
        "command": ("python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])).strip(),
        "started": started, "duration_s": round(duration, 1), "quick": args.quick, "machine": mach,
        "loadavg_min": min(loads), "loadavg_max": max(loads),
        # more runnable work than half the cores, outside the benchmark's own processes
        "loaded": max(loads) > cores * 0.75,
        "figures": [r.to_json() for r in rows], "raw": raw,
    }
    table = [[r.figure, r.what, r.result, r.target, {True: "yes", False: "NO", None: "-"}[r.ok], r.notes]
             for r in rows]
    print()
    print(f"Machine: {cores} cores, {mach['cpu']}, torch {mach['torch']}, Python {mach['python']}; "
          f"load average {doc['loadavg_min']}-{doc['loadavg_max']}"
          + (" (loaded: other jobs running)" if doc["loaded"] else ""))
    print(tabulate(table, headers=["fig", "measurement", "result", "target", "ok", "notes"],
                   maxcolwidths=[None, 34, None, None, None, 70]))
    print(f"\n{len(rows)} figures in {duration / 60:.1f} min; written to {os.path.relpath(json_path)} and "
          f"{os.path.relpath(md_path)}")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(md_path, "w") as f:
        f.write(_markdown(doc))
    missed_bugs = any(r.figure == "4" and r.what.startswith("injected") and not r.ok for r in rows)
    if missed_bugs:
        print("ERROR: the report missed an injected bug", file=sys.stderr)
        return 1
    if args.strict and any(r.ok is False for r in rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
