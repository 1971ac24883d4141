"""The short paths of the DDP step recording (rank/patches/ddp.py) give what the general ones
give: the forward's call site is ``SiteTable.at``'s, and the output hook is installed as
``Tensor.register_hook`` installs it."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from ddpdoctor.rank import callsite
from ddpdoctor.rank.callsite import SiteTable
from ddpdoctor.rank.patches import ddp


class _Probe(torch.nn.Module):
    """Its forward returns (short path's site, ``at``'s site) for the frame DDP's forward sees."""

    def __init__(self, table: SiteTable) -> None:
        super().__init__()
        self.table = table

    def forward(self, x):
        f = sys._getframe(1)  # nn.Module's _call_impl, as in DDP's wrapped forward
        return ddp._forward_site(self.table, f), self.table.at(f)


def _as_recording(monkeypatch) -> None:
    """What activation and ``ddp.patch`` set up: torch is plain library code (a skip prefix)."""
    monkeypatch.setattr(ddp, "_MODULE_GLOBALS", [vars(sys.modules["torch.nn.modules.module"])])
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    monkeypatch.setattr(callsite, "_SKIP_PREFIXES", [*callsite._SKIP_PREFIXES, torch_dir])


def _helper(m):
    return m(1)


def test_forward_site_is_the_general_lookups(monkeypatch):
    _as_recording(monkeypatch)
    table = SiteTable(lambda rec: None)
    m = _Probe(table)
    got = []
    for _ in range(3):
        got.append(m(1))  # line A
        got.append(m(1))  # line B
        got.append(_helper(m))  # through a helper of the user's
    assert all(short == general for short, general in got)
    a, b, c = got[0][1], got[1][1], got[2][1]
    assert len({a, b, c}) == 3 and [g[1] for g in got] == [a, b, c] * 3


class _Short(torch.nn.Module):
    def __init__(self, table: SiteTable) -> None:
        super().__init__()
        self.table = table

    def forward(self, x):
        return ddp._forward_site(self.table, sys._getframe(1))


def test_forward_site_is_looked_up_once_per_line(monkeypatch):
    """The Python short path (no C key: ``callsite._site_key`` None); with the C key ``at``
    itself is the short path, and gives the same site."""
    from ddpdoctor.rank import callsite

    c_key = callsite._site_key
    if c_key is not None:
        table = SiteTable(lambda rec: None)
        s = _Short(table)
        with_c = [s(1) for _ in range(3)]
        assert len(set(with_c)) == 1
    monkeypatch.setattr(callsite, "_site_key", None)
    _as_recording(monkeypatch)
    table = SiteTable(lambda rec: None)
    calls = []
    general = table.at
    monkeypatch.setattr(table, "at", lambda f: calls.append(1) or general(f))
    s = _Short(table)
    sids = [s(1) for _ in range(5)]
    assert len(set(sids)) == 1 and len(calls) == 1  # then the short path alone


def test_hook_output_is_register_hook(monkeypatch):
    x = torch.ones(3, requires_grad=True)
    seen = []
    out = (x * 2).sum()
    monkeypatch.setattr(ddp, "_TENSOR", [torch.Tensor])
    ddp._hook_output(out, lambda g: seen.append(("ours", float(g))))
    out.register_hook(lambda g: seen.append(("user", float(g))))  # a user's hook after ours
    out.backward()
    assert seen == [("ours", 1.0), ("user", 1.0)] and x.grad.tolist() == [2.0, 2.0, 2.0]
    # a tensor that already has hooks takes the public call: both run
    y = (x * 3).sum()
    y.register_hook(lambda g: seen.append(("first", float(g))))
    ddp._hook_output(y, lambda g: seen.append(("second", float(g))))
    y.backward()
    assert seen[2:] == [("first", 1.0), ("second", 1.0)]


class _Rec:
    """What the backward hook uses of the recorder."""

    def __init__(self) -> None:
        self.seq: dict = {}
        self.t0_ns = 0
        self.inflight: dict = {}
        self.writer = None
        self._ddp_ptrs = {"dirty": False, "map": {}}
        self.lines: list[str] = []

    def emit_bytes(self, data: bytes) -> None:
        self.lines.append(data.decode())

    def internal_error(self, exc: BaseException) -> None:
        raise exc


#: The backward hook's implementations: Python, and C where rank/_ddpstep.c is built.
HOOKS = ["python", "c"]


def _hook_class(kind: str):
    if kind == "python":
        return ddp._BackwardHook
    mod = ddp._native(torch)
    if mod is None:
        pytest.skip("rank/_ddpstep.c not built (or DDPDOCTOR_NATIVE=0)")
    return mod.hook


def _hooked(rec, x, kind: str = "python"):
    out = x * 2
    ddp._hook_output(out, _hook_class(kind)(rec, {"g": "0", "bwd": 0, "fwd": 1, "grads": None}, 4))
    return out.sum()


@pytest.mark.parametrize("kind", HOOKS)
def test_the_backward_event_ends_after_the_backward(monkeypatch, kind):
    monkeypatch.setattr(ddp, "_TENSOR", [torch.Tensor])
    rec = _Rec()
    x = torch.ones(3, requires_grad=True)
    for _ in range(2):
        _hooked(rec, x, kind).backward()
    recs = [json.loads(line) for line in rec.lines]
    assert [(r["op"], r["s"], r["site"]) for r in recs] == [("ddp_backward", 1, 4), ("ddp_backward", 2, 4)]
    assert rec.inflight == {} and x.grad.tolist() == [4.0, 4.0, 4.0]


@pytest.mark.parametrize("kind", HOOKS)
def test_a_backward_that_raises_writes_no_event(monkeypatch, kind):
    monkeypatch.setattr(ddp, "_TENSOR", [torch.Tensor])

    class _Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise ValueError("boom")

    rec = _Rec()
    x = torch.ones(3, requires_grad=True)
    loss = _hooked(rec, _Boom.apply(x), kind)
    try:
        loss.backward()
    except ValueError as exc:
        assert str(exc) == "boom"  # the program's own error, unchanged
    else:
        raise AssertionError("the backward's error must propagate")
    assert rec.lines == [] and len(rec.inflight) == 1  # left to staleinflight, as before
