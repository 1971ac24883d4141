"""End to end: every public torch.distributed operation, DDP and a DataLoader with workers, in one
real 2-rank gloo job under ``ddpdoctor trace -- torchrun``; each call must be exactly one event
with the right fields, at the program's own line, and the program must compute what it would
compute without ddpdoctor."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from support.jobs import findings_json, read_records, torchrun, trace

PROGRAMS = Path(__file__).resolve().parent / "programs"
OPS = PROGRAMS / "trace_ops.py"


def markers(program: Path) -> dict[str, int]:
    """``# L:<name>`` markers of a test program -> line numbers."""
    out = {}
    for i, line in enumerate(program.read_text().splitlines(), 1):
        m = re.search(r"# L:([\w:]+)", line)
        if m:
            out[m.group(1)] = i
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    base = tmp_path_factory.mktemp("ops")
    out, results = base / "trace", base / "results"
    results.mkdir()
    res = trace(torchrun(OPS, str(results)), out, "--no-report")
    assert res.returncode == 0, res.stdout + res.stderr
    ranks = {r: read_records(out, r) for r in (0, 1)}
    seen = {r: json.loads((results / f"result-rank{r}.json").read_text()) for r in (0, 1)}
    return {"out": out, "recs": ranks, "seen": seen, "lines": markers(OPS), "res": res}


def sites(recs: list[dict]) -> dict[int, dict]:
    return {r["id"]: r for r in recs if r["t"] == "site"}


def events_by_line(recs: list[dict]) -> dict[int, list[dict]]:
    """Sequence/p2p/wait/local events grouped by the line of their call site."""
    table = sites(recs)
    out: dict[int, list[dict]] = defaultdict(list)
    for r in recs:
        if r["t"] in ("c", "p", "w", "e"):
            site = table[r["site"]]
            assert site["file"] == str(OPS), site
            out[site["line"]].append(r)
    return out


# marker -> (ranks that make the call, expected fields of its one event)
EXPECTED: dict[str, tuple[tuple[int, ...], dict]] = {
    "barrier": ((0, 1), {"t": "c", "op": "barrier", "g": "0"}),
    "monitored_barrier": ((0, 1), {"t": "c", "op": "monitored_barrier", "g": "0"}),
    "all_reduce": ((0, 1), {"t": "c", "op": "all_reduce", "x": ["float32[4]"], "n": 4, "rop": "SUM"}),
    "all_reduce:max": ((0, 1), {"op": "all_reduce", "x": ["float32[2,3]"], "n": 6, "rop": "MAX"}),
    "all_reduce:bound": ((0, 1), {"op": "all_reduce", "x": ["float32[4]"]}),
    "reduce": ((0, 1), {"op": "reduce", "x": ["float32[4]"], "root": 0, "rop": "SUM"}),
    "broadcast": ((0, 1), {"op": "broadcast", "x": ["int64[3]"], "n": 3, "root": 1}),
    "all_gather": ((0, 1), {"op": "all_gather", "x": ["float32[4]"], "xo": ["float32[4]"] * 2}),
    "all_gather_into_tensor": ((0, 1), {"op": "all_gather_into_tensor", "x": ["float32[2]"],
                                        "xo": ["float32[4]"]}),
    # the *_single spellings are recorded under the established names (one op, two names)
    "all_gather_single": ((0, 1), {"op": "all_gather_into_tensor", "x": ["float32[2]"], "xo": ["float32[4]"]}),
    "reduce_scatter_single": ((0, 1), {"op": "reduce_scatter_tensor", "x": ["float32[4]"],
                                       "xo": ["float32[2]"], "rop": "SUM"}),
    "reduce_scatter": ((0, 1), {"op": "reduce_scatter", "x": ["float32[2]"], "xo": ["float32[2]"] * 2,
                                "rop": "SUM"}),
    "reduce_scatter_tensor": ((0, 1), {"op": "reduce_scatter_tensor", "x": ["float32[4]"],
                                       "xo": ["float32[2]"], "rop": "SUM"}),
    "all_to_all": ((0, 1), {"op": "all_to_all", "x": ["float32[1]"] * 2, "xo": ["float32[1]"] * 2}),
    "all_to_all_single": ((0, 1), {"op": "all_to_all_single", "x": ["float32[2]"], "xo": ["float32[2]"]}),
    "gather": ((0, 1), {"op": "gather", "x": ["float32[2]"], "root": 0}),
    "scatter": ((0, 1), {"op": "scatter", "x": ["float32[2]"], "root": 0}),
    "all_reduce:ret": ((0, 1), {"op": "all_reduce", "x": ["float32[1]"]}),
    "send": ((0,), {"t": "p", "op": "send", "ch": "0>1", "s": 1, "x": ["float32[5]"], "n": 5}),
    "recv": ((1,), {"t": "p", "op": "recv", "ch": "0>1", "s": 1, "x": ["float32[5]"]}),
    "all_gather_object": ((0, 1), {"op": "all_gather_object", "obj": ["dict"]}),
    "gather_object": ((0, 1), {"op": "gather_object", "root": 0, "obj": ["tuple"]}),
    "broadcast_object_list": ((0, 1), {"op": "broadcast_object_list", "root": 0, "nobj": 2}),
    "scatter_object_list": ((0, 1), {"op": "scatter_object_list", "root": 0, "nobj": 1}),
    "send_object_list": ((0,), {"t": "p", "op": "send_object_list", "ch": "0>1", "nobj": 1}),
    "recv_object_list": ((1,), {"t": "p", "op": "recv_object_list", "ch": "0>1", "nobj": 1}),
    "new_group": ((0, 1), {"op": "new_group", "g": "0"}),
    "new_group:only0": ((0, 1), {"op": "new_group", "g": "0"}),
    "new_subgroups": ((0, 1), {"op": "new_subgroups", "g": "0"}),
    "all_reduce:subgroup": ((0, 1), {"op": "all_reduce", "s": 1}),
    "barrier:subgroup": ((0, 1), {"op": "barrier", "s": 2}),
    "all_reduce:only0": ((0,), {"op": "all_reduce", "s": 1}),
    "all_reduce:mine": ((0, 1), {"op": "all_reduce", "s": 1}),
    "ddp_init": ((0, 1), {"t": "c", "op": "ddp_init", "g": "0", "np": 4}),
    "ddp_init:plain": ((0, 1), {"t": "c", "op": "ddp_init", "g": "0", "np": 2}),
    "ddp_forward:local": ((0, 1), {"t": "e", "op": "ddp_forward"}),
}
# Calls whose exception the program catches (it re-checks them against the unwrapped function).
MAY_FAIL = {"reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single"}
BAD_ARGS = {"all_reduce:bad": "bad_tensor", "broadcast:bad": "bad_src"}


def test_every_marked_call_is_one_event_with_its_fields(job):
    lines = job["lines"]
    for rank, recs in job["recs"].items():
        by_line = events_by_line(recs)
        for name, (ranks, fields) in EXPECTED.items():
            evs = by_line.get(lines[name], [])
            if rank not in ranks:
                assert evs == [], (rank, name, evs)
                continue
            assert len(evs) == 1, (rank, name, evs)
            ev = evs[0]
            for k, v in fields.items():
                assert ev.get(k) == v, (rank, name, k, ev)
            if name in MAY_FAIL and name in job["seen"][rank]["errors"]:
                assert ev["err"].startswith(job["seen"][rank]["errors"][name][0] + ":"), ev
            else:
                assert "err" not in ev, (rank, name, ev)
            assert isinstance(ev["ts"], int) and isinstance(ev["d"], int) and ev["d"] >= 0


def test_unsupported_or_bad_calls_fail_unchanged_and_are_recorded(job):
    lines = job["lines"]
    for rank, recs in job["recs"].items():
        seen = job["seen"][rank]
        # An op the backend refuses raises what the unwrapped function raises.
        for name in MAY_FAIL & set(seen["errors"]):
            assert seen["errors"][name] == seen["orig_errors"][name], name
        by_line = events_by_line(recs)
        for marker, key in BAD_ARGS.items():
            assert seen["errors"][key] == seen["orig_errors"][key], key
            etype, msg = seen["errors"][key]
            (ev,) = by_line[lines[marker]]
            assert ev["t"] == "c" and ev["err"] == f"{etype}: {msg}"[:500], ev
        assert seen["errors"]["bad_tensor"][0] == "TypeError"


def test_api_of_wrapped_functions_is_unchanged(job):
    for rank in (0, 1):
        api = job["seen"][rank]["api"]
        assert api["wrapped"], "instrumentation was not active"
        assert api["bound_is_patched"] and api["same_in_c10d"]
        assert api["signature"] == api["orig_signature"]
        assert api["signature"].startswith("(tensor, op=")
        assert api["doc_same"] and api["name"] == "all_reduce"


def test_results_are_what_torch_computes(job):
    v0, v1 = job["seen"][0]["values"], job["seen"][1]["values"]
    for v in (v0, v1):
        assert v["all_reduce"] == [2.0] * 4
        assert v["all_reduce_max"] == 1.0
        assert v["broadcast"] == [1, 2, 3]
        assert v["all_gather"] == [0.0, 1.0]
        assert v["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert v["reduce_scatter_single"] == [2.0, 2.0]
        assert v["async_return"] == "Work" and v["all_reduce_return"] == "None"
        assert v["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert v["broadcast_object_list"] == ["from0", 0]
        assert v["steps"] == 2
    assert v0["gather"] == [0.0, 1.0] and v0["gather_object"] == [["r", 0], ["r", 1]]
    assert v0["scatter"] == 0.0 and v1["scatter"] == 1.0
    assert v0["batch"] == 1.0 and v1["batch"] == 0.0
    assert v0["irecv"] == [7, 7]
    assert v1["recv"] == 0.0 and v1["recv_object_list"] == [{"k": 0}]
    assert v0["scatter_object_list"] == ["s0"] and v1["scatter_object_list"] == ["s1"]


def test_async_work_has_a_wait_record(job):
    lines = job["lines"]
    for rank, recs in job["recs"].items():
        by_line = events_by_line(recs)
        issue, wait = by_line[lines["all_reduce:async"]]
        assert issue["t"] == "c" and issue["async"] == 1 and issue["x"] == ["float32[3]"]
        assert wait == {**wait, "t": "w", "op": "all_reduce", "g": "0", "s": issue["s"]}
        assert wait["ts"] >= issue["ts"]
        dropped = by_line[lines["all_reduce:dropped"]]
        assert [(e["t"], e.get("async")) for e in dropped] == [("c", 1)] * 3, dropped
        after = by_line[lines["all_reduce:after_dropped"]]
        assert [(e["t"], e["op"], e.get("async")) for e in after] == [("c", "all_reduce", None)] * 3, after
        # isend/irecv: the message is named by its channel and number, in the p and w records
        op = "isend" if rank == 1 else "irecv"
        p, w = by_line[lines[op]]
        assert (p["t"], p["op"], p["ch"], p["s"], p["async"], p["x"]) == ("p", op, "1>0", 1, 1, ["int64[2]"])
        assert (w["t"], w["op"], w["ch"], w["s"]) == ("w", op, "1>0", 1)
        # batch_isend_irecv: one p record per op, and a wait record for each
        batch = by_line[lines["batch_isend_irecv"]]
        ps = [e for e in batch if e["t"] == "p"]
        ws = [e for e in batch if e["t"] == "w"]
        me, peer = rank, 1 - rank
        assert sorted((e["op"], e["ch"]) for e in ps) == [("irecv", f"{peer}>{me}"), ("isend", f"{me}>{peer}")]
        assert all(e["batch"] == 1 and e["x"] == ["float32[3]"] for e in ps)
        assert sorted((e["op"], e["ch"], e["s"]) for e in ws) == sorted((e["op"], e["ch"], e["s"]) for e in ps)


def test_sequences_per_group_are_contiguous_and_equal_across_ranks(job):
    ops = {}
    for rank, recs in job["recs"].items():
        per_group: dict[str, list] = defaultdict(list)
        for r in recs:
            if r["t"] == "c":
                per_group[r["g"]].append((r["s"], r["op"]))
        for g, seq in per_group.items():
            assert [s for s, _ in seq] == list(range(1, len(seq) + 1)), (rank, g, seq)
        ops[rank] = per_group
    assert ops[0]["0"] == ops[1]["0"]
    # p2p records are per channel, numbered 1.. on both ends
    for _rank, recs in job["recs"].items():
        chans = defaultdict(list)
        for r in recs:
            if r["t"] == "p":
                chans[r["ch"]].append(r["s"])
        assert all(s == list(range(1, len(s) + 1)) for s in chans.values()), chans


def test_groups_init_and_destroy(job):
    lines = job["lines"]
    for rank, recs in job["recs"].items():
        table = sites(recs)
        assert recs[0]["t"] == "header" and recs[0]["rank"] == rank and recs[0]["world"] == 2
        (init,) = [r for r in recs if r["t"] == "init"]
        assert (init["rank"], init["world"], init["backend"], init["g"]) == (rank, 2, "gloo", "0")
        assert table[init["site"]]["line"] == lines["init"]
        pgs = [r for r in recs if r["t"] == "pg"]
        made = [(r["op"], r["ranks"]) for r in pgs if r["op"] != "destroy"]
        expected = [("new_group", [0, 1])] + ([("new_group", [0])] if rank == 0 else [])
        assert made == expected + [("new_subgroups", [rank])]
        by_line = events_by_line(recs)
        names = {tuple(r["ranks"]): r["g"] for r in pgs if r["op"] != "destroy"}
        assert by_line[lines["all_reduce:subgroup"]][0]["g"] == names[(0, 1)] != "0"
        assert by_line[lines["all_reduce:mine"]][0]["g"] == names[(rank,)]
        (destroy,) = [r for r in pgs if r["op"] == "destroy"]
        assert destroy["g"] == "0" and table[destroy["site"]]["line"] == lines["destroy"]
        exits = [r for r in recs if r["t"] == "exit"]
        assert len(exits) == 1 and exits[0]["how"] == "normal" and recs[-1] is exits[0]
        assert sum(1 for r in recs if r["t"] == "header") == 1


def test_ddp_steps_are_in_the_sequence(job):
    lines = job["lines"]
    for _rank, recs in job["recs"].items():
        by_line = events_by_line(recs)
        steps = Counter((e["t"], e["op"]) for e in by_line[lines["ddp_forward"]])
        # BatchNorm buffers are broadcast in every forward: both steps communicate.
        assert steps == {("c", "ddp_forward"): 2, ("c", "ddp_backward"): 2}, steps
        (init,) = by_line[lines["ddp_init"]]
        ddp = [r for r in recs if r["t"] == "ddp"]
        assert len(ddp) == 2
        assert ddp[0]["s"] == init["s"] and ddp[0]["nparams"] == 4 and ddp[0]["nbuffers"] == 3
        assert ddp[0]["params"] == [["0.weight", [3, 4]], ["0.bias", [3]], ["1.weight", [3]], ["1.bias", [3]]]
        assert re.fullmatch(r"[0-9a-f]{8}", ddp[0]["init_fp"]) and ddp[0]["names"]
    d0 = [r for r in job["recs"][0] if r["t"] == "ddp"]
    d1 = [r for r in job["recs"][1] if r["t"] == "ddp"]
    assert [(d["names"], d["init_fp"]) for d in d0] == [(d["names"], d["init_fp"]) for d in d1]


def test_dataloader_workers_leave_no_trace_and_report_is_clean(job):
    out = job["out"]
    files = sorted(p.name for p in out.glob("*.jsonl"))
    assert len(files) == 2 and files[0].startswith("rank00000-") and files[1].startswith("rank00001-")
    assert all(re.fullmatch(r"rank\d{5}-[\w.-]+-\d+-a0\.jsonl", f) for f in files), files
    for recs in job["recs"].values():
        samplers = [r for r in recs if r["t"] == "sampler"]
        assert len(samplers) == 1 and samplers[0]["num_samples"] == 8
    # A correct program: no finding at all.
    assert findings_json(out)["findings"] == []


def test_no_event_outside_the_marked_lines(job):
    """Nothing recorded twice or from inside torch: every event sits on a marked line."""
    marked = set(job["lines"].values())
    for recs in job["recs"].values():
        for line, evs in events_by_line(recs).items():
            assert line in marked, (line, evs)


def test_every_record_type_and_field_written_is_documented(job):
    """docs/trace-format.md stays in sync with what the code writes."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "trace-format.md").read_text()
    documented_types = set(re.findall(r"^### (.+)$", doc, re.M))
    documented_types = {t for line in documented_types for t in re.findall(r"`(\w+)`", line)}
    missing = set()
    for recs in job["recs"].values():
        for r in recs:
            if r["t"] not in documented_types:
                missing.add(("type", r["t"]))
            for key in r:
                if f"`{key}`" not in doc:
                    missing.add((r["t"], key))
    assert not missing, f"undocumented in docs/trace-format.md: {sorted(missing)}"
