"""torch.compile under ddpdoctor: dynamo must not trace ddpdoctor's wrappers (compiled.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from support.jobs import ROOT, findings_json, read_records, run_bounded, torchrun, trace

PROGRAM = ROOT / "tests" / "e2e" / "programs" / "compiled_ddp.py"


def test_compiled_ddp_model_is_recorded_and_its_output_unchanged(tmp_path):
    out = tmp_path / "trace"
    with ThreadPoolExecutor(2) as pool:  # the plain and the traced run side by side (compiling is slow)
        plain_f = pool.submit(run_bounded, torchrun(PROGRAM), timeout=240)
        res = trace(torchrun(PROGRAM), out, "--hang-timeout", "60", "--no-report", timeout=240)
        plain = plain_f.result()
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert res.returncode == 0, res.stderr[-3000:]
    # the same result, and nothing in the program's output that the plain run did not print:
    # no dynamo warning about global module hooks or untraceable builtins, no internal error
    final = [line for line in res.stdout.splitlines() if line.startswith("final ")]
    assert final == [line for line in plain.stdout.splitlines() if line.startswith("final ")]
    for text in ("global hooks", "Dynamo does not know how to trace", "ddpdoctor: internal error"):
        assert text not in res.stderr, res.stderr[-3000:]
    for rank in (0, 1):
        ops = [r["op"] for r in read_records(out, rank) if r["t"] in ("c", "e") and r.get("op", "").startswith("ddp_")]
        assert ops.count("ddp_forward") == 4 and ops.count("ddp_backward") == 4, ops
    assert not findings_json(out)["findings"]
