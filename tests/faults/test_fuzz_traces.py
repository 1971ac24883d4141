"""Hostile trace folders for ``report`` (text, json, html) and ``timeline``: property-based.

Every input must give a result (exit 0/1, possibly partial, with one-line notes) or one
``ddpdoctor: error:`` line and exit 2: never a traceback, never a hang, never terminal control
characters in the text report, never markup from the trace in the HTML page. The analysis runs
in-process through the real command line (click's runner, fast); a few inputs also go through
the installed command in a subprocess. The number of inputs tried is printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ddpdoctor.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COUNT = {"inputs": 0, "invocations": 0, "cli": 0, "check_notes": 0}
#: Per input: four analyses of a few-KB folder; far above what any of them takes.
SLOW_S = 10.0
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

SITE = {"t": "site", "id": 1, "file": "/work/train.py", "line": 27, "func": "main",
        "src": "dist.all_reduce(x)", "stack": [["/work/train.py", 27, "main", "dist.all_reduce(x)"]],
        "conds": [["/work/train.py", 26, "if rank == 0:", "if"]]}


def base_rank(rank: int, world: int = 2, run: str = "fz") -> list[dict]:
    """A realistic small trace: every record kind the report reads."""
    recs = [{"t": "header", "schema": 1, "run": run, "rank": rank, "world": world, "host": "h",
             "pid": 100 + rank, "attempt": 0, "torch": "2.x", "backend": "gloo", "wall0": 1.0,
             "argv": ["train.py"]},
            dict(SITE), {"t": "init", "g": "0", "rank": rank, "world": world, "ts": 10},
            {"t": "pg", "op": "new_group", "g": "1", "ranks": [0, 1], "ts": 20, "site": 1}]
    for s in range(1, 6):
        recs.append({"t": "c", "op": "all_reduce", "g": "0", "x": "float32[4]", "rop": "SUM",
                     "s": s, "ts": 100 * s, "d": 5, "site": 1})
    recs += [{"t": "c", "op": "broadcast" if rank else "barrier", "g": "0", "s": 6, "ts": 700,
              "d": 3, "site": 1, "root": 0},
             {"t": "p", "op": "send" if rank == 0 else "recv", "g": "0", "ch": "0>1", "x": "float32[2]",
              "ts": 800, "d": 2, "site": 1},
             {"t": "w", "op": "all_reduce", "g": "0", "s": 5, "ts": 510, "d": 1, "site": 1},
             {"t": "file", "op": "w" if rank == 0 else "r", "path": "/tmp/ckpt.pt", "pos": {"0": 6},
              "ts": 900, "site": 1},
             {"t": "seed", "fn": "manual_seed", "seed": rank, "ts": 30, "site": 1},
             {"t": "pending", "op": "all_reduce", "g": "0", "s": 7, "ts": 1000, "site": 1, "waited_s": 2},
             {"t": "exit", "how": "exception" if rank else "normal", "exc": "RuntimeError: boom",
              "file": "/work/train.py", "line": 27, "func": "main", "ts": 2000,
              "inflight": [["all_reduce", "0", 7, 1, 1000]]}]
    return recs


def lines_of(recs: list[dict]) -> list[bytes]:
    return [json.dumps(r).encode() + b"\n" for r in recs]


#: Values that a damaged or hostile writer could put in any field.
WEIRD = [None, "", "x", 1e308, float("inf"), float("nan"), -1, 10 ** 30, -(10 ** 30), [], {}, True,
         "\ud800", [[[1]]], {"a": None}, [1, "2", None], "<script>alert(1)</script>",
         "\x1b[2J\x1b]0;pwned\x07", "a" * 5000, 0.5, "../../etc/passwd", "/dev/zero"]


def _dump(rec) -> bytes:
    return json.dumps(rec, allow_nan=True).encode("utf-8", "surrogatepass") + b"\n"


@st.composite
def hostile_folder(draw) -> dict:
    """{file name: bytes | ("fifo",) | ("link", target)} for one trace folder."""
    world = 2
    files: dict[str, list[bytes] | tuple] = {
        f"rank{r:05d}-h-{100 + r}-a0.jsonl": lines_of(base_rank(r, world)) for r in range(world)}
    names = sorted(files)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["bytes", "truncate", "field", "header", "nest", "huge", "utf8",
                                     "future", "duplicate", "special", "drop", "control"]))
        name = draw(st.sampled_from(names))
        lines = files[name] if isinstance(files[name], list) and files[name] else lines_of(base_rank(0))
        if kind == "bytes":
            files[name] = [draw(st.binary(max_size=3000))]
        elif kind == "truncate":
            blob = b"".join(lines)
            files[name] = [blob[:draw(st.integers(0, len(blob)))]]
        elif kind in ("field", "header", "control"):
            idx = 0 if kind == "header" else draw(st.integers(0, len(lines) - 1))
            try:
                rec = json.loads(lines[idx])
            except (ValueError, RecursionError):
                continue
            if not isinstance(rec, dict) or not rec:
                continue
            key = draw(st.sampled_from(sorted(rec) + ["_groups", "ranks", "inflight"]))
            rec[key] = draw(st.sampled_from(WEIRD[-5:-2] if kind == "control" else WEIRD))
            lines = list(lines)
            lines[idx] = _dump(rec)
            files[name] = lines
        elif kind == "nest":
            depth = draw(st.sampled_from([50, 3000, 200000]))
            where = draw(st.integers(0, len(lines)))
            nested = ("[" * depth + "]" * depth).encode()
            if draw(st.booleans()):
                nested = b'{"t":"c","op":"all_reduce","g":"0","s":1,"ts":1,"d":1,"site":1,"x":' + nested + b"}"
            files[name] = list(lines[:where]) + [nested + b"\n"] + list(lines[where:])
        elif kind == "huge":
            size = draw(st.sampled_from([1 << 16, (1 << 20) + 10, 3 << 20]))
            body = b'{"t":"c",' + b'"s":1,"ts":1,"d":1,"site":' * (size // 26) + b"1}"
            if draw(st.booleans()):
                body = b'{"t":"site","id":1,"file":"' + b"a" * size + b'"}'
            files[name] = list(lines[:3]) + [body + b"\n"] + list(lines[3:])
        elif kind == "utf8":
            idx = draw(st.integers(0, len(lines) - 1))
            junk = draw(st.sampled_from([b"\xff\xfe", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\\ud800"]))
            line = lines[idx]
            pos = draw(st.integers(0, len(line)))
            files[name] = list(lines[:idx]) + [line[:pos] + junk + line[pos:]] + list(lines[idx + 1:])
        elif kind == "future":
            try:
                head = json.loads(lines[0])
            except (ValueError, RecursionError, IndexError):
                head = {}
            head = head if isinstance(head, dict) else {}
            head.update(t="header", schema=draw(st.sampled_from([2, 99, 10 ** 20])))
            files[name] = [_dump(head)] + list(lines[1:]) + [b'{"t":"quantum","x":1}\n']
        elif kind == "duplicate":
            files[name.replace("-a0", "-a0x").replace("h-1", "h-9")] = list(lines)
        elif kind == "special":
            files[f"rank{draw(st.integers(2, 4)):05d}-h-1-a0.jsonl"] = draw(st.sampled_from(
                [("fifo",), ("link", "/dev/zero"), ("link", "self"), ("link", "/nonexistent")]))
        elif kind == "drop":
            files.pop(name, None)
            if not files:
                files["rank00000-h-1-a0.jsonl"] = []
            names = sorted(files)
    return files


def materialise(folder: Path, files: dict) -> None:
    folder.mkdir(parents=True)
    for name, content in files.items():
        p = folder / name
        if isinstance(content, tuple):
            if content[0] == "fifo":
                os.mkfifo(p)
            elif content[1] == "self":
                os.symlink(name, p)  # a symlink loop
            else:
                os.symlink(content[1], p)
        else:
            p.write_bytes(b"".join(content))


def check_invocation(args: list[str], res) -> None:
    """One command: a result or one error line; no traceback; nothing unsafe in the output."""
    COUNT["invocations"] += 1
    out, err = res.stdout, res.stderr
    if re.search(r"check DD\d+ \([a-z-]+\) failed", out + err):
        COUNT["check_notes"] += 1  # a partial report: one check could not use this input
    assert res.exit_code in (0, 1, 2), (args, res.exit_code, err[-2000:], repr(res.exception))
    assert res.exception is None or isinstance(res.exception, SystemExit), (args, repr(res.exception))
    assert "Traceback" not in out + err, (args, err[-3000:])
    if res.exit_code == 2:
        errors = [line for line in err.splitlines() if line.startswith("ddpdoctor: error:")]
        assert len(errors) == 1, (args, err[-2000:])
        # exit 2 is for input that holds no usable trace, not a report that broke on one
        assert "internal error" not in err, (args, err[-2000:])
    assert not _CONTROL.search(err), (args, err[-500:])
    fmt = args[args.index("--format") + 1] if "--format" in args else "text"
    if args[0] == "report" and res.exit_code in (0, 1):
        if fmt == "text":
            assert not _CONTROL.search(out), (args, out[-500:])
        elif fmt == "json":
            json.loads(out)
        else:
            assert "<script" not in out.lower() and "onerror=" not in out.lower()
    out.encode("utf-8")


def analyse(folder: Path, tmp: Path) -> None:
    runner = CliRunner()
    for args in (["report", str(folder)], ["report", str(folder), "--format", "json"],
                 ["report", str(folder), "--format", "html", "-v"]):
        check_invocation(args, runner.invoke(main, args))
    tl = tmp / "tl.json"
    args = ["timeline", str(folder), "-o", str(tl)]
    res = runner.invoke(main, args)
    check_invocation(args, res)
    if res.exit_code == 0:
        json.loads(tl.read_text(encoding="utf-8"))


@settings(max_examples=int(os.environ.get("DDPDOCTOR_FUZZ_EXAMPLES", "300")), deadline=None,
          suppress_health_check=list(HealthCheck), derandomize=False, database=None)
@given(files=hostile_folder())
def _fuzz(tmp_root: Path, files: dict) -> None:
    COUNT["inputs"] += 1
    case = tmp_root / f"case{COUNT['inputs']}"
    t0 = time.monotonic()
    materialise(case / "trace", files)
    try:
        analyse(case / "trace", case)
    finally:
        shutil.rmtree(case, ignore_errors=True)
    took = time.monotonic() - t0
    assert took < SLOW_S, f"{took:.1f} s for one input: {sorted(files)}"


@pytest.mark.timeout(240)
def test_hostile_traces_in_process(tmp_path, capsys):
    _fuzz(tmp_path)
    with capsys.disabled():
        print(f"\nfuzz: {COUNT['inputs']} hostile trace folders, {COUNT['invocations']} in-process "
              f"report/timeline runs, 0 failures ({COUNT['check_notes']} partial reports where one "
              f"check could not use the input)")
    assert COUNT["inputs"] >= 50


# ----------------------------------------------------------------------------------------------
# A few inputs through the installed command (the real process, its encoding and exit status).

def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    COUNT["cli"] += 1
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", "ddpdoctor", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT), env=env, errors="replace")


def _assert_clean(res: subprocess.CompletedProcess) -> None:
    assert res.returncode in (0, 1, 2), res.stderr[-2000:]
    assert "Traceback" not in res.stdout + res.stderr, res.stderr[-3000:]
    assert "internal error" not in res.stderr, res.stderr[-2000:]
    if res.returncode == 2:
        assert len([x for x in res.stderr.splitlines() if x.startswith("ddpdoctor: error:")]) == 1


@pytest.mark.timeout(240)
def test_hostile_traces_through_the_command(tmp_path, capsys):
    cases = {}
    evil = base_rank(0)
    evil[1] = dict(SITE, file="/x/<script>alert(1)</script>.py", src="\x1b]0;pwned\x07\x1b[2J<img src=x>")
    evil[-1] = dict(evil[-1], exc="RuntimeError: \ud800 \x1b[31mred\x1b[0m <b>boom</b>")
    cases["evil"] = {"rank00000-h-1-a0.jsonl": [_dump(r) for r in evil],
                     "rank00001-h-2-a0.jsonl": lines_of(base_rank(1))}
    world = base_rank(0)
    world[0] = dict(world[0], world=10 ** 12)
    cases["world"] = {"rank00000-h-1-a0.jsonl": lines_of(world)}
    cases["special"] = {"rank00000-h-1-a0.jsonl": lines_of(base_rank(0)),
                        "rank00001-h-1-a0.jsonl": ("fifo",), "rank00002-h-1-a0.jsonl": ("link", "/dev/zero"),
                        "rank00003-h-1-a0.jsonl": ("link", "self")}
    cases["nest"] = {"rank00000-h-1-a0.jsonl": lines_of(base_rank(0)) + [b"[" * 500000 + b"]" * 500000 + b"\n"]}
    for name, files in cases.items():
        d = tmp_path / name
        materialise(d, files)
        for fmt in ("text", "json", "html"):
            res = _cli("report", str(d), "--format", fmt)
            _assert_clean(res)
            if fmt == "text":
                assert not _CONTROL.search(res.stdout)
            if fmt == "html" and res.returncode in (0, 1):
                assert "<script" not in res.stdout and "&lt;script&gt;" in res.stdout or name != "evil"
        res = _cli("timeline", str(d), "-o", str(tmp_path / f"{name}.json"))
        _assert_clean(res)
    # A 200 MB line (no writer makes one): read past in bounded memory and time.
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "rank00000-h-1-a0.jsonl", "wb") as f:
        f.write(b"".join(lines_of(base_rank(0))[:4]))
        chunk = b"x" * (1 << 20)
        f.write(b'{"t":"site","id":2,"file":"')
        for _ in range(200):
            f.write(chunk)
        f.write(b'"}\n')
        f.write(b"".join(lines_of(base_rank(0))[4:]))
    t0 = time.monotonic()
    for fmt in ("text", "html"):
        res = _cli("report", str(big), "--format", fmt)
        _assert_clean(res)
        assert res.returncode in (0, 1) and "1 corrupt line" in res.stdout + res.stderr
    big_s = time.monotonic() - t0
    # timeline -o into a folder that does not exist: one line, exit 2.
    res = _cli("timeline", str(big), "-o", str(tmp_path / "no" / "such" / "t.json"))
    assert res.returncode == 2 and "cannot write" in res.stderr, res.stderr
    with capsys.disabled():
        print(f"\nfuzz: {COUNT['cli']} command-line runs on hostile folders "
              f"(a 200 MB line: two reports in {big_s:.1f} s), 0 failures")
