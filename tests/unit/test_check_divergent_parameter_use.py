"""divergent-parameter-use (DD016) on hand-written traces (and the forward's source for the
deciding condition)."""

from __future__ import annotations

import textwrap

from support.traces import run_check, write_traces

from ddpdoctor.analysis.checks.divergent_parameter_use import DivergentParameterUse, deciders

SITE = ("train.py", 44)


def used(step: int, names, cnt, mine=None, fwd=None) -> dict:
    r = {"t": "grad_used", "id": 0, "step": step, "world": 2, "names": names, "cnt": cnt, "site": SITE}
    if mine is not None:
        r["mine"] = mine
    if fwd is not None:
        r["fwd"] = fwd
    return r


def model_file(tmp_path, condition: str, body: str = "h = self.extra(h)"):
    src = tmp_path / "net.py"
    src.write_text(textwrap.dedent(f"""\
        import torch
        import torch.distributed as dist


        class Net(torch.nn.Module):
            def forward(self, x):
                h = self.stem(x)
                if {condition}:
                    {body}
                return self.head(h)
        """))
    return str(src)


def test_rank_dependent_branch_is_an_error_naming_module_ranks_and_condition(tmp_path):
    src = model_file(tmp_path, "dist.get_rank() == 0")
    fwd = [["", src, 6, "extra"]]
    names = ["extra.weight", "extra.bias"]
    r0 = [used(1, names, [1, 1], mine=[1, 1], fwd=fwd), {"t": "grad_used", "id": 0, "at": "exit", "steps": 5,
                                                            "of": 5, "site": -1}]
    r1 = [used(1, names, [1, 1], fwd=fwd)]  # rank 1's own read was overtaken by the reduction
    found = run_check(DivergentParameterUse, write_traces(tmp_path / "t", {0: r0, 1: r1}))
    assert [(f.severity, f.data["step"], f.data["users"]) for f in found] == [("error", 1, {"extra": [0]})]
    f = found[0]
    assert f.data["decided_by"] == "rank" and "`extra` (weight, bias) on rank 0 only" in f.message
    assert (f.locations[0].line, f.locations[0].role) == (8, "condition") and "5 of 5" in f.message


def test_random_draw_is_an_error(tmp_path):
    src = model_file(tmp_path, "self.training and torch.rand(()) < 0.5")
    found = run_check(DivergentParameterUse, write_traces(tmp_path / "t", {
        0: [used(3, ["extra.weight"], [1], mine=[0], fwd=[["", src, 6, "extra"]])],
        1: [used(3, ["extra.weight"], [1], mine=[1])]}))
    assert [(f.severity, f.data["decided_by"], f.data["users"]) for f in found] == [("error", "random", {"extra": [1]})]


def test_data_dependent_routing_is_info(tmp_path):
    src = model_file(tmp_path, "x.mean() > 0")
    found = run_check(DivergentParameterUse, write_traces(tmp_path / "t", {
        0: [used(2, ["extra.weight"], [1], fwd=[["", src, 6, "extra"]])], 1: [used(2, ["extra.weight"], [1])]}))
    assert [f.severity for f in found] == ["info"] and "It happened in" not in found[0].message
    assert "1 of 2 ranks" in found[0].message


def test_inconsistent_own_reads_name_no_rank(tmp_path):
    # both ranks claim the parameter while the count says one: a read overtaken by the reduction
    found = run_check(DivergentParameterUse, write_traces(tmp_path, {
        0: [used(1, ["extra.weight"], [1], mine=[1])], 1: [used(1, ["extra.weight"], [1], mine=[1])]}))
    assert found[0].data["users"] == {} and "1 of 2 ranks" in found[0].message


def test_no_partial_use_is_silent(tmp_path):
    assert run_check(DivergentParameterUse, write_traces(tmp_path, {0: [], 1: []})) == []


def test_deciders_follow_the_loop_over_the_child(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(textwrap.dedent("""\
        import random


        class Net:
            def forward(self, x):
                if x is None:
                    return x
                for blk in self.blocks:
                    if random.random() < self.p:
                        continue
                    x = blk(x)
                return x
        """))
    assert [(ln, why) for ln, _t, why in deciders(str(src), 5, "blocks")] == [(9, "random")]
    assert deciders(str(tmp_path / "missing.py"), 5, "blocks") == []


def test_a_random_draw_about_another_module_does_not_decide(tmp_path):
    # the layer drop of `blocks` is random; the partial module is `experts`, routed on the data
    src = tmp_path / "m.py"
    src.write_text(textwrap.dedent("""\
        import torch


        class Net:
            def forward(self, x):
                for blk in self.blocks:
                    if torch.rand(()) < 0.3:
                        continue
                    x = blk(x)
                expert = self.experts[0] if x.mean() > 0 else self.experts[1]
                return expert(x)
        """))
    assert deciders(str(src), 5, "experts") == []
    found = run_check(DivergentParameterUse, write_traces(tmp_path / "t", {
        0: [used(1, ["experts.0.weight"], [1], mine=[1], fwd=[["", str(src), 5, "experts"]])],
        1: [used(1, ["experts.0.weight"], [1], mine=[0])]}))
    assert [(f.severity, f.data["users"]) for f in found] == [("info", {"experts.0": [0]})]


def test_malformed_records_give_no_traceback(tmp_path):
    junk = [{"t": "grad_used", "id": 0, "step": "?", "names": ["a.w", 3], "cnt": ["x"], "mine": "no",
             "fwd": [["", "/nonexistent.py", "x", 5], "bad"], "site": SITE},
            {"t": "grad_used", "id": 0, "at": "exit", "steps": "x", "of": None, "site": -1},
            {"t": "grad_used", "names": "notalist"}]
    found = run_check(DivergentParameterUse, write_traces(tmp_path, {0: junk, 1: []}))
    assert [f.id for f in found] == ["DD016"]


def _fsdp_site(sid: int, file: str, line: int, src: str, conds: list) -> dict:
    return {"t": "site", "id": sid, "file": file, "line": line, "func": "forward", "src": src,
            "stack": [[file, line, "forward", src]], "via": "torch wrapper (_fsdp_common.py:30)",
            "lib": [["/venv/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_state.py", 314, "_pre_forward"]],
            "conds": conds}


def test_fsdp_module_run_on_one_rank_is_named_with_its_condition(tmp_path):
    src = model_file(tmp_path, "dist.get_rank() == 0")  # line 8: the condition, line 9: self.extra(h)
    cond = [[src, 8, "if dist.get_rank() == 0:", "if"]]

    def ag(s: int, n: int) -> dict:
        return {"t": "c", "op": "all_gather_into_tensor", "g": "0", "s": s, "d": 1, "site": 1 if s == 1 else 2,
                "x": [f"float32[{n}]"], "n": n}

    r0 = [_fsdp_site(1, src, 7, "h = self.stem(x)", []), _fsdp_site(2, src, 9, "h = self.extra(h)", cond),
          ag(1, 8), ag(2, 32)]
    r1 = [_fsdp_site(1, src, 7, "h = self.stem(x)", []), _fsdp_site(2, src, 10, "return self.head(h)", []),
          ag(1, 8), ag(2, 4)]
    found = run_check(DivergentParameterUse, write_traces(tmp_path / "t", {0: r0, 1: r1}))
    assert [(f.severity, f.data["seq"], f.ranks) for f in found] == [("error", 2, [0])]
    f = found[0]
    assert f.data["calls"] == {"0": ["self.extra"], "1": ["self.head"]}
    assert "`self.extra` ran on rank 0 only" in f.message
    assert (f.locations[0].line, f.locations[0].role) == (8, "condition")


def test_module_calls_in_evaluation_order_without_library_calls():
    from ddpdoctor.analysis.checks._fsdp_parted import module_calls

    assert module_calls("h = h + s.back(torch.relu(s.extra(h)))") == ["s.extra", "s.back"]
    assert module_calls("if (") == []
