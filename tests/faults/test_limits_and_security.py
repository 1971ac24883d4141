"""Fault matrix, reading limits and security (in-process, no torch job):

- a rank with 205,000 async waits keeps its exit record (the loader used to drop every record
  after 200,000 "rare" ones, so such a rank read as killed);
- the fast path's pattern cannot be made to backtrack (a 22 KB line took 32 s);
- ``report`` reads only regular, bounded, *.py source files named by a trace;
- the text report carries no terminal control sequence from a trace;
- the HTML report never turns trace text into markup (also checked in a browser when one is
  installed: tests/test_html_report.py);
- no pickle, eval or exec anywhere that reads traces;
- files ddpdoctor creates are never world-writable, even under umask 0.
"""

from __future__ import annotations

import ast
import json
import os
import stat
import time
from pathlib import Path

from click.testing import CliRunner

from ddpdoctor.analysis import fastscan, load
from ddpdoctor.analysis.run import load_run
from ddpdoctor.cli import main
from ddpdoctor.trace import sourceinfo

PKG = Path(load.__file__).resolve().parent


def _header(rank: int = 0, world: int = 1) -> dict:
    return {"t": "header", "schema": 1, "run": "lim", "rank": rank, "world": world, "host": "h",
            "pid": 1, "attempt": 0, "torch": "2.x", "backend": "gloo", "wall0": 1.0}


def test_many_async_waits_keep_the_exit_record(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    with open(d / "rank00000-h-1-a0.jsonl", "w") as f:
        f.write(json.dumps(_header()) + "\n")
        for s in range(1, 205001):
            f.write(f'{{"t":"w","op":"all_reduce","g":"0","s":{s},"ts":{s},"d":1,"site":null}}\n')
        f.write(json.dumps({"t": "exit", "how": "normal", "ts": 10 ** 6}) + "\n")
    run = load_run([str(d)])
    rt = run.ranks[0]
    assert rt.exit_record() is not None and rt.exit_record()["how"] == "normal"
    assert rt.async_waits["all_reduce"][0] == 205000
    assert len(rt.rare) < 10  # summarised, not kept one by one
    res = CliRunner().invoke(main, ["report", str(d)])
    assert res.exit_code == 0 and "no exit record" not in res.stdout, res.stdout


def test_fast_path_pattern_is_linear():
    hostile = [b'{"t":"c",' + b'"s":1,' * 4000 + b'"ts":1,"d":1,' * 2000 + b'"x"}\n',
               b'{"t":"c","op":"a",' + b'"s":1,"ts":1,"d":1,"site":' * 2000 + b"x}\n"]
    for line in hostile:
        for pattern in (fastscan.LINE, fastscan.LINE_PLAIN):  # the loader's bulk path (fastscan)
            t0 = time.monotonic()
            assert pattern.match(line) is None
            assert time.monotonic() - t0 < 0.5


def test_report_reads_only_plausible_source_files(tmp_path):
    cfg = tmp_path / "secrets.cfg"
    cfg.write_text("password = 'hunter2'\nif x:\n    pass\n")
    big = tmp_path / "big.py"
    big.write_bytes(b"x = 1\n" * (sourceinfo.MAX_SOURCE_BYTES // 6 + 10))
    fifo = tmp_path / "pipe.py"
    os.mkfifo(fifo)
    good = tmp_path / "train.py"
    good.write_text("for i in range(3):\n    if i:\n        break\n")
    for bad in ("/dev/zero", str(cfg), str(big), str(fifo), str(tmp_path)):
        t0 = time.monotonic()
        assert sourceinfo.source_lines(bad) == [], bad
        assert sourceinfo.loop_exits(bad, 1) == []
        assert time.monotonic() - t0 < 1
    assert sourceinfo.loop_exits(str(good), 1) == [[3, "break", 2, "if i:"]]


def test_text_report_has_no_terminal_control_sequences(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    evil = "\x1b]0;pwned\x07\x1b[2J\x9b31m"
    recs = [_header(), {"t": "site", "id": 1, "file": f"/w/{evil}.py", "line": 3, "func": evil, "src": evil,
                        "stack": [[f"/w/{evil}.py", 3, evil, evil]]},
            {"t": "c", "op": f"all_reduce{evil}", "g": "0", "s": 1, "ts": 1, "d": 1, "site": 1,
             "err": f"RuntimeError: {evil}"},
            {"t": "exit", "how": "exception", "exc": f"RuntimeError: {evil}", "file": f"/w/{evil}.py", "line": 3,
             "func": evil, "ts": 5}]
    (d / "rank00000-h-1-a0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = CliRunner().invoke(main, ["report", str(d), "-v"])
    assert res.exit_code in (0, 1), res.stderr
    assert "pwned" in res.stdout  # the text is there...
    assert not any(c in res.stdout + res.stderr for c in "\x1b\x07\x9b")  # ...its control characters not


def test_html_report_never_turns_trace_text_into_markup(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    js = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    for rank in (0, 1):
        recs = [_header(rank, 2), {"t": "site", "id": 1, "file": f"/w/{js}.py", "line": 3, "func": js,
                                   "src": js, "stack": [[f"/w/{js}.py", 3, js, js]]},
                {"t": "c", "op": "all_reduce" if rank else js, "g": "0", "s": 1, "ts": 1, "d": 1, "site": 1},
                {"t": "exit", "how": "exception", "exc": f"RuntimeError: {js}", "file": js, "line": 3, "ts": 5}]
        (d / f"rank{rank:05d}-h-{rank}-a0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = CliRunner().invoke(main, ["report", str(d), "--format", "html", "-v"])
    assert res.exit_code in (0, 1), res.stderr
    from html.parser import HTMLParser

    class Tags(HTMLParser):
        found: list = []

        def handle_starttag(self, tag, attrs):
            self.found.append((tag, [k for k, _v in attrs]))

    parser = Tags()
    parser.feed(res.stdout)
    tags = {t for t, _a in parser.found}
    handlers = [k for _t, attrs in parser.found for k in attrs if k.startswith("on")]
    assert not tags & {"script", "img", "iframe", "object", "embed"} and not handlers, (tags, handlers)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in res.stdout  # shown, as text


_FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
_FORBIDDEN_MODULES = {"pickle", "marshal", "shelve", "dill", "cloudpickle", "yaml"}
#: Modules that run inside the traced program, never on trace content (the bootstrap imports).
_RANK_SIDE = {"activate.py", "_bootstrap"}
#: The one reader of pickles (PyTorch's Flight Recorder dumps): through an unpickler that refuses
#: every global, checked below.
_PICKLE_READER = "frdump.py"


def _refuses_every_global(tree: ast.Module) -> bool:
    """Every Unpickler subclass overrides find_class with a body that only raises, and nothing
    calls pickle.load/loads directly."""
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
               and any(isinstance(b, ast.Attribute) and b.attr == "Unpickler" for b in n.bases)]
    for cls in classes:
        finds = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "find_class"]
        if not finds or not any(isinstance(n, ast.Raise) for n in ast.walk(finds[0])) or \
                any(isinstance(n, ast.Return) for n in ast.walk(finds[0])):
            return False
    direct = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("load", "loads")
              and isinstance(n.value, ast.Name) and n.value.id == "pickle"]
    return bool(classes) and not direct


def test_no_pickle_eval_or_exec_on_trace_content():
    for path in sorted(PKG.rglob("*.py")):
        if any(part in _RANK_SIDE for part in path.relative_to(PKG).parts):
            continue
        tree = ast.parse(path.read_text(), str(path))
        pickle_ok = path.name == _PICKLE_READER and _refuses_every_global(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in _FORBIDDEN_CALLS, f"{path}:{node.lineno}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                bad = {n.split(".")[0] for n in names} & _FORBIDDEN_MODULES
                assert not (bad - {"pickle"} if pickle_ok else bad), f"{path}:{node.lineno}"
            if isinstance(node, ast.Attribute) and node.attr == "load" and \
                    isinstance(node.value, ast.Name) and node.value.id == "torch":
                raise AssertionError(f"torch.load in {path}:{node.lineno}")


def test_created_files_are_never_world_writable(tmp_path):
    from ddpdoctor.trace.files import TraceWriter
    from ddpdoctor.trace.inflight import InflightSlot
    from ddpdoctor.trace.outfault import open_private

    old = os.umask(0)
    try:
        w = TraceWriter(str(tmp_path / "rank00000-h-1-a0.jsonl"))
        w.write_line("{}")
        w.close()
        InflightSlot(str(tmp_path / "rank00000-h-1-a0.inflight")).close()
        with open_private(str(tmp_path / "hang-1.txt")) as f:
            f.write("x")
        with open_private(str(tmp_path / "stacks.txt"), append=True) as f:
            f.write("x")
    finally:
        os.umask(old)
    for p in tmp_path.iterdir():
        assert not p.stat().st_mode & stat.S_IWOTH, (p, oct(p.stat().st_mode))
        assert not p.stat().st_mode & stat.S_IWGRP, (p, oct(p.stat().st_mode))
