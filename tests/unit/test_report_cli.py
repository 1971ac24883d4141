"""The output contract of ``ddpdoctor report``: text layout and order, the JSON document
(docs/report-format.md), exit codes, --select/--ignore/--fail-on, and bad input (one clear line
or a partial report with a note, never a traceback).

Runs the real command line on hand-written trace folders (no torch job needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.jobs import report
from support.traces import GLOO_CLOSED, coll, ddp_record, raised, write_run

MS = 1000
BAR = ("train.py", 34, "dist.barrier()")
STEP = ("train.py", 36, "model(x)")


def _loop(rank: int, steps: int = 60) -> list[dict]:
    out = [coll(1, "ddp_init", ("train.py", 20)), ddp_record()]
    s = 2
    for _ in range(steps):
        out.append(coll(s, "barrier", BAR, d=(21 if rank == 0 else 1) * MS))
        out.append({"t": "e", "op": "ddp_forward", "g": "0", "s": 0, "d": 50, "site": STEP, "grad": 1})
        out.append(coll(s + 1, "ddp_backward", STEP, d=2 * MS))
        s += 2
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """Four ranks: ranks 1-3 raise the same ValueError (DD008, error), rank 0 fails with a
    connection error (collateral); a subgroup created with different members (DD012, error); a
    barrier on every DDP step (DD010, info)."""
    ranks = {}
    for r in range(4):
        recs = _loop(r)
        members = [0, 1] if r < 2 else [2, 3]
        recs.append({"t": "pg", "op": "new_group", "g": "1", "ranks": members, "site": ("train.py", 12)})
        if r == 0:
            recs.append(coll(122, "all_reduce", ("train.py", 40), err=GLOO_CLOSED))
        ranks[r] = recs
    exits = {0: raised(GLOO_CLOSED, line=40)}
    exits.update({r: raised("ValueError: bad shard", line=17, func="load") for r in (1, 2, 3)})
    return write_run(tmp_path_factory.mktemp("mixed") / "trace", ranks, exits=exits)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    ranks = {r: [coll(1), coll(2, "barrier")] for r in (0, 1)}
    return write_run(tmp_path_factory.mktemp("clean") / "trace", ranks)


def no_traceback(res) -> None:
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr


def headers(text: str) -> list[str]:
    return [line.split(" — ")[0] for line in text.splitlines() if line.startswith("[")]


# -- text ---------------------------------------------------------------------------------------
def test_text_layout_and_order(mixed):
    res = report(mixed)
    no_traceback(res)
    assert res.returncode == 1
    out = res.stdout
    assert out.startswith("ddpdoctor report: run unit — world size 4, backend gloo")
    assert "Findings: 2 errors, 1 info" in out
    # severity first, then check id
    assert headers(out) == ["[1] ERROR DD008 rank-failed", "[2] ERROR DD012 collective-misuse",
                            "[3] info DD010 sync-overhead"]
    block = out.split("[1] ERROR DD008")[1].split("[2] ERROR")[0]
    assert "    ranks: 1-3\n" in block  # rank lists are grouped
    assert "    at train.py:17 in load() (exception, rank 1)" in block
    assert "Ranks 1-3 raised ValueError: bad shard at train.py:17" in " ".join(block.split())
    assert "\n    fix: Fix the error of the rank named here" in block
    assert "evidence:" not in out


def test_verbose_adds_evidence(mixed):
    res = report(mixed, "--verbose")
    assert res.returncode == 1
    block = res.stdout.split("[1] ERROR DD008")[1].split("[2] ERROR")[0]
    assert "    evidence:" in block and "root cause" in block and "collateral" in block


def test_clean_run(clean):
    res = report(clean)
    no_traceback(res)
    assert res.returncode == 0 and "No findings" in res.stdout


# -- JSON ---------------------------------------------------------------------------------------
def test_json_document(mixed):
    res = report(mixed, "--format", "json")
    no_traceback(res)
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    assert doc["schema"] == "ddpdoctor.report/1"
    run = doc["run"]
    assert run["id"] == "unit" and run["world_size"] == 4 and run["ranks_found"] == [0, 1, 2, 3]
    assert run["ranks_missing"] == [] and run["backend"] == "gloo" and isinstance(run["notes"], list)
    assert [f["id"] for f in doc["findings"]] == ["DD008", "DD012", "DD010"]
    assert doc["summary"] == {"error": 2, "warning": 0, "info": 1}
    for f in doc["findings"]:
        assert {"id", "category", "severity", "title", "message", "ranks", "locations", "fix"} <= set(f)
        assert f["severity"] in ("error", "warning", "info") and isinstance(f["ranks"], list)
        assert all(isinstance(r, int) for r in f["ranks"])
        for loc in f["locations"]:
            assert {"rank", "file", "line", "function"} <= set(loc)
            assert isinstance(loc["line"], int) and isinstance(loc["rank"], int)
    dd008 = doc["findings"][0]
    assert dd008["ranks"] == [1, 2, 3] and dd008["locations"][0] == {
        "rank": 1, "file": "train.py", "line": 17, "function": "load", "source": "x = load()",
        "role": "exception"}


def test_output_file(mixed, tmp_path):
    out = tmp_path / "r.json"
    res = report(mixed, "--format", "json", "-o", out)
    assert res.returncode == 1 and res.stdout == "" and "report written to" in res.stderr
    assert json.loads(out.read_text())["schema"] == "ddpdoctor.report/1"


# -- exit codes and selection ---------------------------------------------------------------------
@pytest.mark.parametrize("args, code, ids", [
    (["--fail-on", "never"], 0, ["DD008", "DD012", "DD010"]),
    (["--select", "DD010"], 0, ["DD010"]),  # info only, fail-on error
    (["--select", "sync-overhead", "--fail-on", "info"], 1, ["DD010"]),
    (["--select", "DD010", "--fail-on", "warning"], 0, ["DD010"]),
    (["--select", "DD012,rank-failed"], 1, ["DD008", "DD012"]),
    # without rank-failed the divergence it explained is reported by divergent-collectives
    (["--ignore", "DD008", "--ignore", "collective-misuse,sync-overhead"], 1, ["DD001"]),
])
def test_exit_codes_and_selection(mixed, args, code, ids):
    res = report(mixed, "--format", "json", *args)
    no_traceback(res)
    assert res.returncode == code, res.stderr
    assert [f["id"] for f in json.loads(res.stdout)["findings"]] == ids


def test_unknown_check_is_a_usage_error(mixed):
    res = report(mixed, "--select", "DD999")
    no_traceback(res)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "unknown check 'DD999'" in res.stderr


# -- bad input ----------------------------------------------------------------------------------
def test_missing_and_empty_folders(tmp_path):
    for path, words in ((tmp_path / "nope", "no such file or folder"), (tmp_path, "no ddpdoctor trace files")):
        res = report(path)
        no_traceback(res)
        assert res.returncode == 2 and res.stdout == ""
        assert res.stderr.startswith("ddpdoctor: error: ") and words in res.stderr
        assert res.stderr.count("\n") == 1


def test_files_that_are_not_traces(tmp_path):
    (tmp_path / "rank00000-h-1-a0.jsonl").write_bytes(b"\x00\x01 not json\n")
    (tmp_path / "rank00001-h-2-a0.jsonl").write_text("")
    (tmp_path / "rank00002-h-3-a0.jsonl").write_text('{"t": "header", "rank": "x", "world": 2}\n')
    res = report(tmp_path)
    no_traceback(res)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "no readable ddpdoctor trace" in res.stderr


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _file(folder: Path, rank: int) -> Path:
    return sorted(folder.glob(f"rank{rank:05d}-*.jsonl"))[0]


def test_corrupt_lines_give_a_note_and_a_partial_report(mixed, tmp_path):
    folder = _copy(mixed, tmp_path / "t")
    f = _file(folder, 2)
    lines = f.read_text().splitlines(True)
    lines[5:5] = ["{not json\n", '{"t": "c", "op": 7, "g": [1]}\n', '["a list"]\n',
                  '{"t": "c", "op": "barrier", "g": "0", "s": "x", "d": "slow"}\n']
    f.write_text("".join(lines))
    res = report(folder)
    no_traceback(res)
    assert res.returncode == 1
    assert f"note: {f.name}: 4 corrupt line(s) skipped" in res.stdout
    assert headers(res.stdout)[0] == "[1] ERROR DD008 rank-failed"


def test_truncated_last_line(mixed, tmp_path):
    folder = _copy(mixed, tmp_path / "t")
    f = _file(folder, 1)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 25])  # the exit record cut in the middle
    res = report(folder, "--format", "json")
    no_traceback(res)
    doc = json.loads(res.stdout)
    assert any("last line truncated" in n for n in doc["run"]["notes"])
    assert "ddpdoctor: note:" in res.stderr and "truncated" in res.stderr
    assert doc["findings"], "the rest of the run is still reported"


def test_missing_rank_file(mixed, tmp_path):
    folder = _copy(mixed, tmp_path / "t")
    _file(folder, 3).unlink()
    res = report(folder)
    no_traceback(res)
    assert "missing ranks: 3" in res.stdout and "no trace for rank(s) 3 of 4" in res.stdout
    assert "[1] ERROR DD008 rank-failed" in res.stdout


def test_two_runs_in_one_folder(mixed, tmp_path):
    folder = _copy(mixed, tmp_path / "t")
    later = write_run(tmp_path / "other", {r: [coll(1)] for r in (0, 1)}, run="later", wall0=50.0)
    for f in later.glob("*.jsonl"):
        shutil.copy(f, folder / f.name.replace("-h-", "-other-"))
    res = report(folder)
    no_traceback(res)
    assert res.returncode == 0 and "run later" in res.stdout.splitlines()[0]
    assert "the folder holds 2 runs; reporting run later, ignoring unit (4 files)" in res.stdout
    res = report(folder, "--run", "unit", "--format", "json")
    assert res.returncode == 1 and json.loads(res.stdout)["run"]["id"] == "unit"
    res = report(folder, "--run", "nosuch")
    no_traceback(res)
    assert res.returncode == 2 and "run nosuch not found" in res.stderr
