"""Flight Recorder dumps as report input: real dumps of buggy gloo jobs run without ddpdoctor.

Each job (tests/e2e/fr_programs/fr_job.py) runs 3 ranks; every rank dumps
``torch._C._distributed_c10d._dump_fr_trace()`` from a background thread while its main thread
hangs, as NCCL's watchdog does on a timeout. The jobs run in parallel, once per module.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PY, ROOT, free_port, kill_tree, report
from support.traces import group_coll as coll
from support.traces import write_traces

from ddpdoctor.analysis import frdump

PROGRAM = ROOT / "tests" / "e2e" / "fr_programs" / "fr_job.py"
SCENARIOS = ("divergent", "skipped_barrier", "mismatch", "dead_rank", "uneven_ddp", "wrapped")
JOB_TIMEOUT = 180

pytestmark = pytest.mark.timeout(400)


def culprit_line(scenario: str) -> int:
    for i, line in enumerate(PROGRAM.read_text().splitlines(), 1):
        if f"# culprit: {scenario} " in line:
            return i
    raise AssertionError(scenario)


def line_of(text: str) -> int:
    for i, line in enumerate(PROGRAM.read_text().splitlines(), 1):
        if line.strip() == text:
            return i
    raise AssertionError(text)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """Every scenario's dump folder (plus ``divergent_json``), from jobs run side by side."""
    base = tmp_path_factory.mktemp("fr")
    jobs = {s: [s] for s in SCENARIOS}
    jobs["divergent_json"] = ["divergent", "json"]
    procs = {}
    for name, args in jobs.items():
        env = dict(os.environ, FR_JOB_PORT=str(free_port()), PYTHONUNBUFFERED="1")
        procs[name] = subprocess.Popen([PY, str(PROGRAM), args[0], str(base / name), *args[1:]],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=env, cwd=str(ROOT))
    deadline = time.time() + JOB_TIMEOUT
    outputs = {}
    for name, p in procs.items():
        try:
            outputs[name] = p.communicate(timeout=max(1.0, deadline - time.time()))[0]
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)
            outputs[name] = (p.communicate()[0] or "") + "\n(timed out)"
    for name, p in procs.items():
        assert p.returncode == 0, f"{name}: the job did not leave its dumps:\n{outputs[name][-3000:]}"
    return {name: base / name for name in jobs}


def report_json(*args) -> tuple[dict, subprocess.CompletedProcess]:
    res = report(*args, "--format", "json")
    assert res.returncode in (0, 1), res.stderr
    assert "Traceback" not in res.stderr
    return json.loads(res.stdout), res


def only(doc: dict, category: str) -> dict:
    found = [f for f in doc["findings"] if f["category"] == category]
    assert len(found) == 1, [(f["category"], f["message"]) for f in doc["findings"]]
    return found[0]


def culprit_at(f: dict, rank: int, line: int, role: str = "call") -> None:
    assert f["ranks"] == [rank], f["message"]
    assert any(loc["rank"] == rank and loc["line"] == line and loc["role"] == role
               and loc["file"].endswith("fr_job.py") for loc in f["locations"]), f["locations"]
    assert "Flight Recorder" in f["message"]


@pytest.mark.parametrize("scenario,category,rank", [
    ("divergent", "divergent-collectives", 0),
    ("skipped_barrier", "divergent-collectives", 2),
    ("mismatch", "collective-mismatch", 1),
    ("uneven_ddp", "divergent-collectives", 1),
    ("wrapped", "divergent-collectives", 0),
])
def test_real_dump_names_culprit_and_line(dumps, scenario, category, rank):
    doc, _res = report_json(dumps[scenario])
    assert doc["run"]["id"] == "fr" and doc["run"]["backend"] == "gloo"
    culprit_at(only(doc, category), rank, culprit_line(scenario))
    assert len(doc["findings"]) == 1, [f["message"] for f in doc["findings"]]


def test_divergent_names_the_condition_and_rank0_can_be_the_culprit(dumps):
    doc, _ = report_json(dumps["divergent"])
    f = only(doc, "divergent-collectives")
    assert f["data"]["seq"] == 6 and f["data"]["culprit"] == [0]  # the majority decides, not rank 0
    cond = [loc for loc in f["locations"] if loc["role"] == "condition"]
    assert cond and cond[0]["source"] == "if rank == 0:" and cond[0]["line"] == culprit_line("divergent") - 1


def test_uneven_ddp_bucket_allreduce_is_seen_at_the_backward_line(dumps):
    doc, _ = report_json(dumps["uneven_ddp"])
    f = only(doc, "divergent-collectives")
    backward = line_of("loss.backward()  # ranks 0 and 2 wait in a gradient all-reduce rank 1 never joins")
    assert any(loc["rank"] in (0, 2) and loc["line"] == backward for loc in f["locations"])
    assert "via backward" in f["message"]


def test_dead_rank_without_dump_is_the_culprit_of_the_stuck_collective(dumps):
    doc, _ = report_json(dumps["dead_rank"])
    assert doc["run"]["ranks_missing"] == [1]
    assert any("no Flight Recorder dump for rank(s) 1" in n for n in doc["run"]["notes"])
    f = only(doc, "hang")
    assert f["data"]["missing"] == [1] and f["data"]["waiting"] == [0, 2]
    assert f["ranks"] == [1]  # the culprit left no dump: the line is where the others wait for it
    assert any(loc["line"] == culprit_line("dead_rank") and loc["role"] == "wait" for loc in f["locations"])


def test_wrapped_ring_buffers_align_by_sequence_id(dumps):
    doc, _ = report_json(dumps["wrapped"])
    f = only(doc, "divergent-collectives")
    assert f["data"]["seq"] == 61  # 60 all_reduces, then rank 0's extra one
    notes = " ".join(doc["run"]["notes"])
    assert "ring buffers wrapped" in notes and "rank 0 from #42" in notes and "ranks 1-2 from #27" in notes


def test_json_form_without_stacks(dumps):
    folder = dumps["divergent_json"]
    assert sorted(os.listdir(folder)) == [f"fr_trace_rank_{r}.json" for r in range(3)]
    doc, _ = report_json(folder)
    f = only(doc, "divergent-collectives")
    assert f["ranks"] == [0] and f["data"]["seq"] == 6
    assert "no stacks" in f["message"]
    assert any("hold no Python stacks" in n for n in doc["run"]["notes"])


def test_missing_rank_is_named_and_the_rest_compared(dumps, tmp_path):
    for r in (0, 2):
        shutil.copy(dumps["divergent"] / f"fr_trace_rank_{r}", tmp_path / f"fr_trace_rank_{r}")
    doc, _ = report_json(tmp_path)
    assert doc["run"]["ranks_missing"] == [1]
    assert any("no Flight Recorder dump for rank(s) 1" in n for n in doc["run"]["notes"])
    f = only(doc, "divergent-collectives")
    assert f["ranks"] == [0]  # a tie of one against one: decided by the rank-dependent condition


def test_text_html_and_timeline_accept_dumps(dumps, tmp_path):
    res = report(dumps["divergent"])
    assert res.returncode == 1 and "DD001" in res.stdout and "FR dump" in res.stdout, res.stdout
    html = tmp_path / "r.html"
    res = report(dumps["divergent"], "--format", "html", "-o", html)
    assert res.returncode == 1, res.stderr
    assert "divergent-collectives" in html.read_text()
    out = tmp_path / "t.json"
    res = subprocess.run([PY, "-m", "ddpdoctor", "timeline", str(dumps["wrapped"]), "-o", str(out)],
                         capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr
    events = json.loads(out.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("ph") == "X" and e.get("name", "").startswith("all_reduce")) >= 3 * 19


def test_mixed_folder_prefers_ddpdoctor_traces(dumps, tmp_path):
    write_traces(tmp_path, {r: [coll("0", 1, "all_reduce", x=["float32[4]"])] for r in range(3)})
    for r in range(3):
        shutil.copy(dumps["divergent"] / f"fr_trace_rank_{r}", tmp_path / f"nccl_dump_{r}")
    doc, _ = report_json(tmp_path)
    assert doc["run"]["id"] == "unit" and doc["findings"] == []
    assert any("--run fr" in n for n in doc["run"]["notes"])
    doc, _ = report_json(tmp_path, "--run", "fr")
    assert only(doc, "divergent-collectives")["ranks"] == [0]


class _Hostile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_hostile_pickle_is_refused_without_side_effect(dumps, tmp_path):
    victim = tmp_path / "pwned"
    for r in range(3):
        shutil.copy(dumps["divergent"] / f"fr_trace_rank_{r}", tmp_path / f"fr_trace_rank_{r}")
    (tmp_path / "fr_trace_rank_3").write_bytes(pickle.dumps({"entries": [_Hostile(victim)]}, protocol=2))
    res = report(tmp_path)
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpdoctor: error: refusing") and "posix.system" in lines[0]
    assert not victim.exists()


def test_other_files_are_not_dumps(dumps, tmp_path):
    for r in range(3):
        shutil.copy(dumps["divergent"] / f"fr_trace_rank_{r}", tmp_path / f"fr_trace_rank_{r}")
    (tmp_path / "notes.pkl").write_bytes(pickle.dumps([1, 2, 3], protocol=2))
    (tmp_path / "config.json").write_text('{"lr": 0.1}')
    (tmp_path / "fr_trace_rank_x").write_bytes((dumps["divergent"] / "fr_trace_rank_0").read_bytes())
    doc, res = report_json(tmp_path)
    assert only(doc, "divergent-collectives")["ranks"] == [0]
    assert any("whose rank is unknown" in n for n in doc["run"]["notes"])


def test_reader_refuses_every_global(tmp_path):
    p = tmp_path / "d0"
    p.write_bytes(pickle.dumps({"entries": [], "pg_config": {}, "x": Path("/")}, protocol=2))
    with pytest.raises(frdump.DumpRefused):
        frdump.read(str(p), "pickle")
    p.write_bytes(pickle.dumps({"version": "2.10", "entries": [], "pg_config": {}}, protocol=2))
    assert frdump.read(str(p), "pickle") == {"version": "2.10", "entries": [], "pg_config": {}}
    assert frdump.rank_of("/x/nccl_trace_rank_12", {}) == 12
    assert frdump.rank_of("/x/dump3.json", {}) == 3
    assert frdump.rank_of("/x/dump", {"rank": 5}) == 5
    assert frdump.rank_of("/x/dump", {}) is None


def _nccl_entry(seq, p2p, name, sizes, state="completed", frames=None):
    return {"record_id": seq + p2p, "pg_id": 0, "process_group": ("0", "default_pg"),
            "collective_seq_id": seq, "p2p_seq_id": p2p, "profiling_name": name,
            "time_created_ns": 10**18 + 1000 * (seq + p2p), "input_sizes": sizes, "input_dtypes": ["Float"] * len(sizes),
            "output_sizes": sizes, "output_dtypes": ["Float"] * len(sizes), "state": state, "retired": state == "completed",
            "time_discovered_completed_ns": 10**18 + 1000 * (seq + p2p) + 500 if state == "completed" else None,
            "is_p2p": p2p > 0, "frames": frames or []}


def test_trace_built_while_converting_equals_reading_the_file(dumps, tmp_path):
    """The converter computes the RankTrace itself (no second pass): it must be exactly what
    load.read_rank makes of the converted file, for every real dump and for NCCL-like p2p."""
    from ddpdoctor.analysis import frmodel, load

    files = [f for name in ("divergent", "uneven_ddp", "mismatch", "divergent_json") for f in dumps[name].iterdir()]
    nccl = tmp_path / "nccl_trace_rank_0"
    nccl.write_bytes(pickle.dumps({"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                                          "ranks": "[0, 1]"}},
                                   "entries": [_nccl_entry(1, 0, "nccl:all_reduce", [[4]]),
                                               _nccl_entry(0, 1, "nccl:send 0->1", [[2]]),
                                               _nccl_entry(3, 0, "nccl:_allgather_base", [[4]], "started")]},
                                  protocol=2))
    files.append(nccl)
    for f in files:
        out = tmp_path / "x.jsonl"
        s = frmodel.convert((str(f), frdump.sniff(str(f)), str(out)))
        direct, read = s["trace"], load.read_rank(str(out))
        assert read.problems == []
        assert list(direct.tail) == list(read.tail)[-frmodel.FR_TAIL:]  # a shorter tail, by design
        direct.tail = read.tail
        assert direct == read, f
    assert direct.p2p["0:0>1"][0] == 1 and [e["op"] for e in direct.tail] == ["all_reduce", "send",
                                                                               "all_gather_into_tensor"]
    assert direct.tail[-1]["pending"] == 1 and direct.world == 2 and direct.header["backend"] == "nccl"


def test_traced_hang_also_leaves_each_ranks_flight_recorder_dump(tmp_path):
    """Under ``ddpdoctor trace``, the watchdog writes each rank's FR buffer at a hang: the
    report names the dumps, and ``--run fr`` reads them. The job (``--on-hang report``: it keeps
    waiting) is ended once both dumps are there."""
    from conftest import torchrun

    cases = ROOT / "tests" / "e2e" / "hang_programs" / "cases.py"
    out = tmp_path / "t"
    env = dict(os.environ, EXAMPLE_PG_TIMEOUT="60", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([PY, "-m", "ddpdoctor", "trace", "--out", str(out), "--hang-timeout", "3",
                             "--no-report", "--", *torchrun(cases, "divergent", nproc=2)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=str(ROOT))
    want = ["fr_trace_rank_00000", "fr_trace_rank_00001"]

    def done() -> bool:  # both dumps, and the reporter's diagnosis (its hang-N.json follows its
        # hang record: a dump can be complete before the reporter has gathered every status)
        return sorted(p.name for p in out.glob("fr_trace_rank_*")) == want and any(out.glob("hang-*.json"))

    try:
        deadline = time.time() + 60
        while time.time() < deadline and not done():
            time.sleep(0.2)
    finally:
        kill_tree(proc.pid)
        proc.wait(10)
    assert sorted(p.name for p in out.glob("fr_trace_rank_*")) == want
    doc, _ = report_json(out)
    assert doc["run"]["id"] != "fr" and any("--run fr" in n for n in doc["run"]["notes"])
    assert any(f["category"] == "hang" and f["ranks"] == [0] for f in doc["findings"])
    doc, _ = report_json(out, "--run", "fr")
    f = only(doc, "divergent-collectives")
    assert f["ranks"] == [0] and any(loc["source"].startswith("dist.all_reduce(x)") for loc in f["locations"])
