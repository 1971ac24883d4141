"""The rank side of nonfinite-gradients (rank/patches/grads.py), in one process without a process
group: a fake recorder collects the records; the hook is called as DDP's backward hook calls it."""

from __future__ import annotations

import torch
from support.fakerec import FakeRecorder

from ddpdoctor.rank.patches import grads


class _FakeDDP:
    def __init__(self, module) -> None:
        self.module = module


_alive: list = []  # the recorder holds DDP modules weakly, as it does a real one


def _setup():
    rec = FakeRecorder()
    net = torch.nn.Linear(3, 2)
    ddp = _FakeDDP(net)
    _alive.append(ddp)
    g = grads._Grads(rec, 0, ddp)
    return rec, net, g


def test_finite_backward_records_nothing():
    rec, _net, g = _setup()
    for step in range(1, 4):
        g(torch.ones(4, 2), step, 5)
    assert rec.out == [] and rec.errors == []


def test_nonfinite_output_gradient_then_no_step_is_a_local_and_a_skip():
    rec, _net, g = _setup()
    g(torch.ones(4, 2), 1, 5)
    bad = torch.ones(4, 2)
    bad[1, 1] = float("nan")
    g(bad, 2, 5)
    g(torch.ones(4, 2), 3, 5)  # the next backward came first: nothing stepped
    assert [(r["at"], r["step"], r.get("kind"), r.get("pnf"), r.get("how")) for r in rec.out] == [
        ("local", 2, "nan", 0, None), ("skip", 2, None, None, "none")]
    assert rec.errors == []


def test_an_optimizer_step_with_nonfinite_gradients_is_an_apply():
    rec, net, g = _setup()
    grads._state["mods"].append(g)
    grads._state["opt"].clear()
    try:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        bad = torch.full((4, 2), float("inf"))
        g(bad, 1, 5)
        net.weight.grad = torch.full_like(net.weight, float("nan"))
        net.bias.grad = torch.zeros_like(net.bias)
        grads._before_step(opt, (), {})
        assert [(r["at"], r.get("kind"), r.get("n"), r.get("names"), r["site"]) for r in rec.out] == [
            ("local", "inf", None, None, 5), ("apply", None, 1, ["weight"], 7)]
        # the parameters are non-finite once applied: the next local says so, and the exit too
        opt.step()
        g(bad, 2, 5)
        g.at_exit()
        assert [(r["at"], r.get("pnf")) for r in rec.out[2:]] == [("local", 1), ("skip", None), ("exit", 1)]
    finally:
        grads._state["mods"].remove(g)
        grads._state["opt"].clear()


def test_records_are_capped_then_counted():
    rec, _net, g = _setup()
    bad = torch.full((2, 2), float("nan"))
    for step in range(1, 12):
        g(bad, step, 5)
    g.at_exit()
    assert sum(r["at"] == "local" for r in rec.out) == grads.CAP
    assert [r["counts"] for r in rec.out if r["at"] == "count"] == [{"local": 11, "skip": 11}]


def test_odd_gradients_never_raise():
    rec, _net, g = _setup()
    g(None, 1, 5)
    g(torch.ones(3, dtype=torch.int64), 2, 5)
    g(torch.ones(3, dtype=torch.float16) * float("inf"), 3, 5)
    assert rec.errors == [] and [r["kind"] for r in rec.out if r["at"] == "local"] == ["inf"]


def test_a_sum_that_overflows_is_no_finding():
    rec, _net, g = _setup()
    big = torch.full((4, 2), 3e38)  # finite float32 elements whose sum is +inf
    for step in range(1, 4):
        g(big, step, 5)
    assert rec.out == [] and rec.errors == []
    big[0, 0] = float("inf")
    g(big, 4, 5)
    assert [(r["at"], r["kind"]) for r in rec.out] == [("local", "inf")]
