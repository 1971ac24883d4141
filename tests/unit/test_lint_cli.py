"""`ddpdoctor lint` end to end: the command as a subprocess on files (exit codes, text, JSON,
SARIF validated against the official SARIF 2.1.0 schema, --select/--ignore/--fail-on,
suppression comments, [tool.ddpdoctor.lint] settings), and the repository's own programs:
every checks/*/bad.py whose bug shows in the source is found at its line, and no correct
program gets an error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "tests" / "data" / "sarif-schema-2.1.0.json"

#: checks/<category>/bad.py -> (id, primary line) the linter must report (every category whose bug
#: shows in the source; hang/bad.py's hang is a rank-divergent DDP forward, DD001).
BAD = {
    "collective-mismatch": [("DD002", 22)],
    "collective-misuse": [("DD012", 27), ("DD012", 36)],
    "ddp-manual-allreduce": [("DD005", 29)],
    "divergent-collectives": [("DD001", 24)],
    "hang": [("DD001", 26)],
    "missing-barrier": [("DD003", 33)],
    "p2p-mismatch": [("DD011", 23)],
    "rank-failed": [("DD008", 17)],
    "sampler-misuse": [("DD007", 27)],
    "sync-overhead": [("DD010", 34)],
    "uneven-inputs": [("DD006", 33)],
    "unseeded-rng": [("DD004", 25), ("DD004", 27)],
    "batchnorm-sync": [("DD014", 26)],
    "replica-drift": [("DD013", 28)],
}
#: Deliberately buggy examples and their documented bugs.
EXAMPLES_BUGGY = {
    "examples/train_buggy.py": [("DD004", 30), ("DD007", 39), ("DD005", 45), ("DD003", 54), ("DD001", 64)],
    "examples/divergent_branch.py": [("DD001", 21)],
}


def run(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("DDPDOCTOR_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "ddpdoctor", "lint", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


def as_json(*args: str, cwd: Path = ROOT) -> tuple[int, dict]:
    p = run(*args, "--format", "json", cwd=cwd)
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, json.loads(p.stdout)


def primary(doc: dict) -> list[tuple[str, int]]:
    return [(f["id"], f["locations"][0]["line"]) for f in doc["findings"]]


BUGGY = textwrap.dedent("""\
    import torch
    import torch.distributed as dist

    def main():
        rank = dist.get_rank()
        if rank == 0:
            dist.all_reduce(torch.ones(1))
        dist.barrier()
    """)
WARN_ONLY = textwrap.dedent("""\
    import torch.distributed as dist

    def body(rank):
        if rank == 0:
            dist.barrier()
    """)


# -- the repository's programs ------------------------------------------------------------------

def test_every_bad_program_is_found_at_its_line():
    rc, doc = as_json(*[f"checks/{c}/bad.py" for c in BAD], *EXAMPLES_BUGGY)
    assert rc == 1
    got = {}
    for f in doc["findings"]:
        loc = f["locations"][0]
        got.setdefault(loc["file"], set()).add((f["id"], loc["line"]))
        assert f["source"] == "static" and f["data"]["source"] == "static"
    for cat, want in BAD.items():
        for item in want:
            assert item in got.get(f"checks/{cat}/bad.py", set()), (cat, item, got.get(f"checks/{cat}/bad.py"))
    for path, want in EXAMPLES_BUGGY.items():
        for item in want:
            assert item in got.get(path, set()), (path, item, got.get(path))


def test_no_correct_program_gets_an_error():
    paths = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "checks").glob("*/good.py"))]
    paths += ["tests/e2e/correct_programs", "examples/test_distributed_example.py"]
    rc, doc = as_json(*paths)
    errs = [(f["locations"][0]["file"], f["locations"][0]["line"], f["message"]) for f in doc["findings"]
            if f["severity"] == "error"]
    assert errs == []
    assert rc == 0
    assert doc["lint"]["files"] >= 16


# -- exit codes, formats, selection -------------------------------------------------------------

def test_exit_codes_and_text(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(BUGGY)
    p = run(str(bad))
    assert p.returncode == 1
    assert f"{bad}:7: ERROR DD001 divergent-collectives" in p.stdout
    assert "if rank == 0:" in p.stdout and "fix:" in p.stdout
    good = tmp_path / "good.py"
    good.write_text("import torch.distributed as dist\ndist.barrier()\n")
    p = run(str(good))
    assert p.returncode == 0 and "No findings" in p.stdout
    p = run(str(tmp_path / "missing.py"))
    assert p.returncode == 2 and "no such file" in p.stderr and "Traceback" not in p.stderr
    p = run(str(bad), str(tmp_path / "missing.py"))  # a partial result with a note
    assert p.returncode == 1 and "no such file" in p.stdout
    p = run(str(bad), "--select", "DD099")
    assert p.returncode == 2 and "unknown check 'DD099'" in p.stderr


def test_output_file_keeps_stdout_empty(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(BUGGY)
    out = tmp_path / "out.json"
    p = run(str(bad), "--format", "json", "-o", str(out))
    assert p.returncode == 1 and p.stdout == ""
    assert "written to" in p.stderr
    assert json.loads(out.read_text())["summary"]["error"] == 1


def test_unparsable_file_is_a_note_not_a_traceback(tmp_path):
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "bad.py").write_text(BUGGY)
    p = run(str(tmp_path))
    assert p.returncode == 1
    assert "broken.py:1: does not parse" in p.stdout and "Traceback" not in p.stderr


def test_select_ignore_fail_on(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text(BUGGY)
    assert run(str(f), "--ignore", "DD001").returncode == 0
    assert run(str(f), "--ignore", "divergent-collectives").returncode == 0
    assert run(str(f), "--select", "DD003,DD005").returncode == 0
    assert run(str(f), "--select", "divergent-collectives").returncode == 1
    assert run(str(f), "--fail-on", "never").returncode == 0
    w = tmp_path / "warn.py"
    w.write_text(WARN_ONLY)
    assert run(str(w)).returncode == 0
    assert run(str(w), "--fail-on", "warning").returncode == 1


def test_json_document(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text(BUGGY)
    rc, doc = as_json(str(f))
    assert rc == 1
    assert doc["schema"] == "ddpdoctor.lint/1" and doc["source"] == "static"
    assert doc["summary"] == {"error": 1, "warning": 0, "info": 0}
    (finding,) = doc["findings"]
    assert finding["id"] == "DD001" and finding["category"] == "divergent-collectives"
    assert [(loc["line"], loc["role"]) for loc in finding["locations"]] == [(7, "call"), (6, "condition")]
    assert finding["data"]["condition_line"] == 6


def test_suppression_comment_end_to_end(tmp_path):
    f = tmp_path / "s.py"
    f.write_text(BUGGY.replace("dist.all_reduce(torch.ones(1))",
                               "dist.all_reduce(torch.ones(1))  # ddpdoctor: ignore[DD001] rank 0's own group"))
    p = run(str(f))
    assert p.returncode == 0 and "1 suppressed" in p.stdout


def test_pyproject_settings(tmp_path):
    src = textwrap.dedent("""\
        import torch.distributed as dist

        def step(ctx):
            if ctx.leader:
                publish(ctx)
            dist.barrier()
        """)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text(src)
    p = run("pkg", cwd=tmp_path)
    assert p.returncode == 0
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent("""\
        [tool.ddpdoctor.lint]
        rank-names = ["leader"]
        communicating-functions = ["publish"]
        """))
    p = run("pkg", cwd=tmp_path)
    assert p.returncode == 1 and "DD001" in p.stdout
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent("""\
        [tool.ddpdoctor.lint]
        rank-names = ["leader"]
        communicating-functions = ["publish"]
        ignore = ["DD001"]
        """))
    assert run("pkg", cwd=tmp_path).returncode == 0
    (tmp_path / "pyproject.toml").write_text("[tool.ddpdoctor.lint]\nrank-names = \"leader\"\n")
    p = run("pkg", cwd=tmp_path)
    assert p.returncode == 2 and "rank-names must be a list of strings" in p.stderr
    (tmp_path / "pyproject.toml").write_text("[tool.ddpdoctor.lint]\nexclude = [\"pkg/*\"]\n")
    p = run("pkg", cwd=tmp_path)
    assert p.returncode == 2 and "no Python files" in p.stderr


# -- SARIF ----------------------------------------------------------------------------------------

def test_sarif_validates_against_the_official_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    out = tmp_path / "out.sarif"
    p = run("checks/divergent-collectives/bad.py", "checks/missing-barrier/bad.py", "examples/train_buggy.py",
            "--format", "sarif", "-o", str(out))
    assert p.returncode == 1, p.stderr
    doc = json.loads(out.read_text())
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker()).validate(doc)
    run0 = doc["runs"][0]
    rules = run0["tool"]["driver"]["rules"]
    from ddpdoctor.lint import catalog

    assert [r["id"] for r in rules] == sorted(catalog.CHECKS)  # every check id, in order
    assert rules[0]["properties"]["docs"] == "checks/divergent-collectives/README.md"
    assert "helpUri" not in rules[0]  # no public URL unless configured
    results = run0["results"]
    assert {r["ruleId"] for r in results} >= {"DD001", "DD003", "DD004", "DD005", "DD007"}
    for r in results:
        loc = r["locations"][0]["physicalLocation"]
        assert loc["artifactLocation"]["uriBaseId"] == "%SRCROOT%"
        assert loc["region"]["startLine"] >= 1 and r["message"]["text"]
        assert rules[r["ruleIndex"]]["id"] == r["ruleId"]
        assert r["properties"]["source"] == "static"
    prints = [r["partialFingerprints"]["ddpdoctor/v1"] for r in results]
    assert len(set(prints)) == len(prints)


def test_sarif_help_uri_and_stable_fingerprints(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    f = tmp_path / "bad.py"
    f.write_text(BUGGY)
    p = run(str(f), "--format", "sarif", "--docs-url", "https://example.org/ddpdoctor/blob/main/", cwd=tmp_path)
    doc = json.loads(p.stdout)
    jsonschema.Draft4Validator(json.loads(SCHEMA.read_text())).validate(doc)
    rule = doc["runs"][0]["tool"]["driver"]["rules"][0]
    assert rule["helpUri"] == "https://example.org/ddpdoctor/blob/main/checks/divergent-collectives/README.md"
    before = doc["runs"][0]["results"][0]["partialFingerprints"]
    f.write_text("# a comment\n\n" + BUGGY)  # the code moves down two lines
    after_doc = json.loads(run(str(f), "--format", "sarif", cwd=tmp_path).stdout)
    res = after_doc["runs"][0]["results"][0]
    assert res["locations"][0]["physicalLocation"]["region"]["startLine"] == 9
    assert res["partialFingerprints"] == before


def test_pre_commit_hook_definition():
    text = (ROOT / ".pre-commit-hooks.yaml").read_text()
    assert "id: ddpdoctor-lint" in text and "entry: ddpdoctor lint" in text and "types: [python]" in text


def test_the_linter_imports_nothing_of_the_rank_side_nor_torch():
    code = ("import sys; from ddpdoctor.lint import lint; lint(['checks/hang/bad.py']); "
            "print(sorted(m for m in sys.modules if m.startswith(('ddpdoctor', 'torch'))))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    mods = json.loads(p.stdout.strip().replace("'", '"'))
    assert not [m for m in mods if m.startswith("torch")]
    # its own packages (lint, and the source analysis below it), the findings type, the errors
    assert [m for m in mods if not m.startswith(("ddpdoctor.lint", "ddpdoctor.source"))] == \
        ["ddpdoctor", "ddpdoctor.analysis", "ddpdoctor.analysis.findings", "ddpdoctor.errors"]
