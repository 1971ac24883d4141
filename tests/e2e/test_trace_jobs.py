"""End to end: ``ddpdoctor trace`` over the ways a job is started and ends — torch.multiprocessing
spawn, plain multiprocessing.Process children, a process that never joins a group, exit codes and
signals, a user's own sitecustomize, a rank SIGKILLed mid-run, a rank-divergent branch."""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path

from support.jobs import PY, findings_json, free_port, read_records, report, torchrun, trace

PROGRAMS = Path(__file__).resolve().parent / "programs"


def markers(program: Path) -> dict[str, int]:
    out = {}
    for i, line in enumerate(program.read_text().splitlines(), 1):
        m = re.search(r"# L:([\w:]+)", line)
        if m:
            out[m.group(1)] = i
    return out


def site_line(recs: list[dict], sid) -> tuple[str, int]:
    for r in recs:
        if r["t"] == "site" and r["id"] == sid:
            return r["file"], r["line"]
    raise AssertionError(f"no site {sid}")


def seq_ops(recs: list[dict]) -> list[tuple]:
    return [(r["g"], r["s"], r["op"]) for r in recs if r["t"] == "c"]


def check_worker_ranks(out: Path, program: Path, failing_rank: int, exc_type: str) -> None:
    """Both ranks traced at the program's lines; the failing rank's exception is its exit."""
    lines = markers(program)
    files = sorted(p.name for p in out.glob("*.jsonl"))
    assert len(files) == 2, files
    for rank in (0, 1):
        recs = read_records(out, rank)
        assert recs[0]["t"] == "header" and recs[0]["rank"] == rank and recs[0]["world"] == 2
        (init,) = [r for r in recs if r["t"] == "init"]
        assert site_line(recs, init["site"]) == (str(program), lines["init"])
        evs = [r for r in recs if r["t"] == "c"]
        assert [site_line(recs, e["site"])[1] for e in evs] == [lines[e["op"]] for e in evs]
        assert [e["s"] for e in evs] == list(range(1, len(evs) + 1))
        exits = [r for r in recs if r["t"] == "exit"]
        assert len(exits) == 1 and not [r for r in recs[recs.index(exits[0]):] if r["t"] in ("c", "p")]
        if rank == failing_rank:
            assert exits[0]["how"] == "exception" and exits[0]["exc"].startswith(exc_type + ":")
            assert (exits[0]["file"], exits[0]["line"]) == (str(program), lines["raise"])
        else:
            assert exits[0]["how"] == "normal"
    assert seq_ops(read_records(out, 0)) == seq_ops(read_records(out, 1))


def test_torch_multiprocessing_spawn(tmp_path):
    program = PROGRAMS / "trace_spawn.py"
    out = tmp_path / "trace"
    res = trace([PY, str(program), str(free_port())], out, "--no-report")
    assert res.returncode == 1, res.stderr  # mp.spawn re-raises the worker's error: exit 1
    assert "ValueError: rank 1 fails after the job" in res.stderr
    check_worker_ranks(out, program, failing_rank=1, exc_type="ValueError")
    ops = [op for _g, _s, op in seq_ops(read_records(out, 0))]
    assert ops == ["all_reduce", "broadcast", "barrier", "all_gather_object"]


def test_plain_multiprocessing_children_fork_and_spawn(tmp_path):
    program = PROGRAMS / "trace_mp_process.py"
    out = tmp_path / "trace"
    res = trace([PY, str(program), str(free_port())], out, "--no-report")
    assert res.returncode == 1, res.stderr
    # Rank 0 is a forked child (it leaves through os._exit), rank 1 a spawned one; rank 1's
    # exception is caught by multiprocessing, never by sys.excepthook.
    check_worker_ranks(out, program, failing_rank=1, exc_type="KeyError")


def test_no_process_group_no_trace_exit_code_and_user_sitecustomize(tmp_path):
    usersite = tmp_path / "usersite"
    usersite.mkdir()
    marker = tmp_path / "marker"
    (usersite / "sitecustomize.py").write_text(
        "import os\nUSER_MARK = 'ran'\n"
        "with open(os.environ['USER_SITE_MARKER'], 'w') as f:\n    f.write('ran')\n")
    out = tmp_path / "trace"
    res = trace([PY, str(PROGRAMS / "trace_noinit.py"), "exit", "3"], out,
                env={"PYTHONPATH": str(usersite), "USER_SITE_MARKER": str(marker)})
    assert res.returncode == 3, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    # ddpdoctor was active (torch.distributed patched) and the user's sitecustomize still ran.
    assert info == {"patched": True, "user_sitecustomize": "ran", "sum": 3.0}
    assert marker.read_text() == "ran"
    assert list(out.iterdir()) == []
    assert "no rank traced" in res.stderr


def test_signal_exit_status_without_user_sitecustomize(tmp_path):
    out = tmp_path / "trace"
    res = trace([PY, str(PROGRAMS / "trace_noinit.py"), "signal", str(int(signal.SIGTERM))], out)
    assert res.returncode == 128 + signal.SIGTERM, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info == {"patched": True, "user_sitecustomize": None, "sum": 3.0}
    assert not list(out.glob("*.jsonl"))


def test_unknown_command_is_a_one_line_error(tmp_path):
    out = tmp_path / "trace"
    res = trace(["no-such-command-ddpdoctor-test", "x"], out)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "no-such-command-ddpdoctor-test" in res.stderr
    assert res.stderr.startswith("ddpdoctor: error:")
    assert not out.exists()


def test_sigkilled_rank_leaves_a_readable_trace(tmp_path):
    program = PROGRAMS / "trace_killed.py"
    lines = markers(program)
    out = tmp_path / "trace"
    res = trace(torchrun(program), out, "--no-report")
    assert res.returncode == 1, res.stderr  # torchrun: a worker failed
    raw = next(out.glob("rank00001-*.jsonl")).read_bytes()
    # Whole lines, then only the NUL padding of the mapped file's reserved tail
    # (docs/trace-format.md, Crash safety).
    raw = raw.rstrip(b"\0")
    assert raw.endswith(b"\n") and b"\0" not in raw
    recs = [json.loads(line) for line in raw.splitlines()]  # every line is whole
    killed = [r for r in recs if r["t"] == "c"]
    assert [(r["op"], r["s"]) for r in killed] == [("all_reduce", 1), ("all_reduce", 2), ("all_reduce", 3)]
    assert site_line(recs, killed[-1]["site"])[1] == lines["all_reduce"]
    assert not [r for r in recs if r["t"] == "exit"] and recs[-1] is killed[-1]
    # The survivor's next collective fails (or torchrun ends it first): never a normal exit.
    r0 = read_records(out, 0)
    ev0 = [r for r in r0 if r["t"] == "c"]
    assert [(r["op"], r["s"]) for r in ev0[:3]] == [("all_reduce", 1), ("all_reduce", 2), ("all_reduce", 3)]
    assert all("err" in r for r in ev0[3:]) and len(ev0) <= 4
    assert [r["how"] for r in r0 if r["t"] == "exit"] in ([], ["exception"])
    rep = report(out)
    assert rep.returncode in (0, 1), rep.stderr
    row = next(line for line in rep.stdout.splitlines() if line.strip().startswith("1 "))
    assert "all_reduce #3" in row and "no exit record" in row, rep.stdout
    # A rank killed in the middle of a write leaves a partial last line: read up to it.
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    f1 = next(cut.glob("rank00001-*.jsonl"))
    with open(f1, "r+b") as f:  # cut short inside the reserved tail, as a killed store leaves it
        f.seek(len(raw))
        f.write(b'{"t":"c","op":"all_reduce","g":"0","s":4,"x":["flo')
    data = findings_json(cut)
    assert any("truncated" in n for n in data["run"]["notes"]), data["run"]["notes"]
    assert data["run"]["ranks_found"] == [0, 1]


def test_report_shows_first_divergence_with_both_lines(tmp_path):
    program = PROGRAMS / "trace_divergent.py"
    lines = markers(program)
    out = tmp_path / "trace"
    res = trace(torchrun(program), out, "--no-report", env={"EXAMPLE_PG_TIMEOUT": "3"})
    assert res.returncode == 1, res.stderr
    rep = report(out)
    assert rep.returncode == 1, rep.stdout + rep.stderr
    text = rep.stdout
    assert "divergent-collectives" in text and "#4" in text
    assert f"trace_divergent.py:{lines['all_reduce:metric']}" in text
    assert f"trace_divergent.py:{lines['barrier']}" in text
    assert "`if rank == 0:`" in text
    data = findings_json(out)
    (f,) = [f for f in data["findings"] if f["category"] == "divergent-collectives"]
    calls = {(loc["rank"], loc["line"]) for loc in f["locations"] if loc["role"] == "call"}
    assert calls == {(0, lines["all_reduce:metric"]), (1, lines["barrier"])}

