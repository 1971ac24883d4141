"""ddp-manual-allreduce (DD005): collectives on a DDP model's gradients or parameters.

Unit tests of the check on hand-written traces and of the recorder's overlap lookup on real tensors
(the bad/good programs run end to end in tests/e2e)."""

from __future__ import annotations

import types
import weakref

import torch
from support.traces import group_coll as coll
from support.traces import run_check, write_traces

from ddpdoctor.analysis.checks.ddp_manual_allreduce import DdpManualAllreduce
from ddpdoctor.rank.patches.ddp import overlap

GRADS = ["fc.weight.grad", "fc.bias.grad"]


def step(s: int, op: str = "all_reduce", names=GRADS, rop: str = "SUM", backward: bool = True) -> list[dict]:
    out = [coll("0", s, "ddp_backward", site=("train.py", 25))] if backward else []
    ev = coll("0", s + 1, op, site=("train.py", 30, "dist.all_reduce(p.grad)"), x=["float32[2]"])
    if op != "broadcast":
        ev["rop"] = rop
    if names:
        ev["ddp_overlap"] = list(names)
    return out + [ev]


def check(tmp_path, per_rank: list[dict]):
    ranks = {r: [coll("0", 1, "ddp_init", site=("train.py", 20))] + per_rank for r in (0, 1)}
    return run_check(DdpManualAllreduce, write_traces(tmp_path / "t", ranks))


def test_sum_of_averaged_gradients_is_an_error(tmp_path):
    found = check(tmp_path, step(2) + step(4))
    assert len(found) == 1
    fd = found[0]
    assert (fd.id, fd.severity, fd.ranks) == ("DD005", "error", [0, 1])
    assert fd.data["names"] == GRADS and fd.data["calls"] == 4 and fd.data["target"] == "grad"
    assert "fc.weight.grad, fc.bias.grad" in fd.message and "world size (2)" in fd.message
    assert [(loc.line, loc.role) for loc in fd.locations] == [(30, "call")]


def test_average_again_is_a_warning_and_parameters_are_warned(tmp_path):
    assert [(x.severity, x.data["target"]) for x in check(tmp_path, step(2, rop="AVG"))] == [("warning", "grad")]
    found = check(tmp_path / "b", step(2, names=["fc.weight"]))
    assert [(x.severity, x.data["target"]) for x in found] == [("warning", "param")]
    assert "Parameters" in found[0].title


def test_silent_cases(tmp_path):
    assert check(tmp_path, step(2, names=None)) == []  # the loss / a metric
    assert check(tmp_path / "b", step(2, op="broadcast", names=["fc.weight"])) == []  # copies equal values
    # the gradients never went through DDP's backward (model.module(x)): this is the only reduction
    assert check(tmp_path / "c", step(2, backward=False)) == []


class _Wrapped:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module


def _rec(module: torch.nn.Module):
    holder = _Wrapped(module)
    rec = types.SimpleNamespace(ddp_refs=[weakref.ref(holder)])
    return rec, holder


def test_overlap_tells_bucket_views_apart():
    # gradient_as_bucket_view=True: every gradient is a view into one flat bucket
    fc = torch.nn.Linear(3, 2)
    bucket = torch.zeros(8)
    fc.weight.grad = bucket[:6].view(2, 3)
    fc.bias.grad = bucket[6:]
    rec, _holder = _rec(fc)
    assert overlap(rec, [fc.bias.grad]) == ["bias.grad"]
    assert overlap(rec, [fc.weight.grad]) == ["weight.grad"]
    assert overlap(rec, [bucket]) == ["weight.grad", "bias.grad"]
    assert overlap(rec, [fc.weight]) == ["weight"]
    assert overlap(rec, [torch.zeros(2)]) == []


def test_overlap_ignores_ddps_own_reduction():
    # a communication hook all-reduces the bucket during DDP's backward (in flight until its end)
    fc = torch.nn.Linear(3, 2)
    fc.bias.grad = torch.ones(2)
    rec, _holder = _rec(fc)
    rec.inflight = {("ddp_bwd", 1): ("ddp_backward", "0", 2, 0, 0)}
    assert overlap(rec, [fc.bias.grad]) == []
    rec.inflight = {}
    assert overlap(rec, [fc.bias.grad]) == ["bias.grad"]


def test_overlap_ignores_freed_gradient_memory():
    fc = torch.nn.Linear(3, 2)
    fc.bias.grad = torch.ones(2)
    rec, _holder = _rec(fc)
    old = fc.bias.grad
    assert overlap(rec, [old]) == ["bias.grad"]  # the map is built now
    fc.bias.grad = None  # zero_grad(set_to_none=True): the memory may now hold a logged loss
    assert overlap(rec, [old]) == []
