"""Figure 6: speed of the static linter (``ddpdoctor lint``), in lines of source per second.

Corpus: real code, not generated. The repository's own Python files plus the sources of the
installed ``torch.distributed`` package (found with ``importlib.util.find_spec``: located, never
imported). The linter runs in this process on the whole corpus (every file of it in one program, so
the interprocedural fixpoint covers all of it). Reported: the best wall-clock rate over the
repetitions, and the rate in CPU time of this process (what one core does when the machine is not
shared; the wall figure suffers from other jobs on a loaded machine). Target: >= 20,000 lines/s.
"""

from __future__ import annotations

import importlib.util
import os
import time

from .common import ROOT, Row, loadavg

TARGET = 20_000


def corpus() -> list[str]:
    paths = [str(ROOT / d) for d in ("ddpdoctor", "tests", "checks", "examples", "bench")]
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        dist = os.path.join(list(spec.submodule_search_locations)[0], "distributed")
        if os.path.isdir(dist):
            paths.append(dist)
    return paths


def run(quick: bool, log=print) -> tuple[list[Row], dict]:
    from ddpdoctor.lint import lint

    paths = corpus()
    reps = 1 if quick else 3
    results = []
    for i in range(reps):
        load = loadavg()
        t0, c0 = time.perf_counter(), time.process_time()
        res = lint(paths)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        results.append({"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "lines": res.lines,
                        "files": len(res.files), "findings": len(res.findings), "loadavg": load})
        log(f"    lint rep {i + 1}/{reps}: {res.lines} lines in {len(res.files)} files, {wall:.2f} s wall, "
            f"{cpu:.2f} s CPU, {len(res.findings)} findings, load {load}")
    best = min(results, key=lambda r: r["wall_s"])
    best_cpu = min(results, key=lambda r: r["cpu_s"])
    wall_rate = best["lines"] / best["wall_s"]
    cpu_rate = best_cpu["lines"] / best_cpu["cpu_s"]
    row = Row("6", f"lint speed: {best['lines']:,} lines ({best['files']} files: this repository + "
                   f"torch.distributed's sources)",
              f"{wall_rate:,.0f} lines/s wall ({cpu_rate:,.0f}/s CPU time)", f">= {TARGET:,}/s",
              wall_rate >= TARGET,
              notes=f"best of {reps}; load average {best['loadavg']} during the best run", value=wall_rate,
              data={"runs": results, "cpu_rate": cpu_rate})
    return [row], {"runs": results, "paths": paths}
