"""rank/_ddpstep.c: DD015's element test and when the C backward hook leaves DD015 to Python."""

from __future__ import annotations

import pytest
import torch

from ddpdoctor.rank.patches import ddp

native = ddp._native(torch)  # loaded and set up as ddp.patch does
if native is None:
    pytest.skip("rank/_ddpstep.c not built (or DDPDOCTOR_NATIVE=0)", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_finite_reads_every_element(dtype):
    x = torch.arange(40, dtype=dtype)
    assert native.all_finite(x) is True
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[39] = bad  # the last element: the whole range is read
        assert native.all_finite(y) is False
    y = x.clone()
    y[0] = float("nan")
    assert native.all_finite(y[1:]) is True  # a view: from its own first element (data_ptr)
    assert native.all_finite(torch.empty(0, dtype=dtype)) is True
    big = torch.full((10,), 3e38, dtype=torch.float32)
    assert native.all_finite(big) is True and not torch.isfinite(big.sum())  # elements, not a sum


def test_all_finite_leaves_other_tensors_to_torch():
    x = torch.ones(4, 6)

    class Sub(torch.Tensor):
        pass

    for t in (x.t(), x.half(), x.long(), x.to_sparse(), x.as_subclass(Sub), torch.ones(3, dtype=torch.bfloat16),
              None, 1.0):
        assert native.all_finite(t) is None


class _Grads:
    """What the C hook reads of grads._Grads: ``quiet``, ``fast``; records its calls."""

    def __init__(self, quiet: bool, fast) -> None:
        self.quiet, self.fast, self.calls = quiet, fast, []

    def __call__(self, grad, step, site) -> None:
        self.calls.append((step, site, bool(torch.isfinite(grad).all())))


class _Rec:
    def __init__(self) -> None:
        self.seq: dict = {}
        self.t0_ns = 0
        self.inflight: dict = {}
        self.writer = None
        self._ddp_ptrs = {"dirty": False, "map": {}}
        self.lines: list[bytes] = []
        self.errors: list = []

    def emit_bytes(self, data: bytes) -> None:
        self.lines.append(data)

    def internal_error(self, exc: BaseException) -> None:
        self.errors.append(exc)


def _backward(rec, info, scale: float, transpose: bool = False) -> None:
    x = torch.ones(3, 4, requires_grad=True)
    out = x * 2
    hook = native.hook(rec, info, 9)
    ddp._hook_output(out, hook)
    (out.t() if transpose else out).mul(scale).sum().backward()


@pytest.mark.parametrize("quiet,fast,scale,transpose,called", [
    (True, torch.float32, 1.0, False, False),   # steady state, finite: nothing for Python to do
    (True, torch.float32, float("nan"), False, True),  # a NaN: Python decides (and records)
    (True, torch.float32, float("inf"), False, True),
    (False, torch.float32, 1.0, False, True),   # not quiet (first backward, pending step...)
    (True, torch.float64, 1.0, False, True),    # another dtype than the one seen before
    (True, torch.float32, 1.0, True, True),     # a non-contiguous gradient
])
def test_hook_calls_python_check_unless_quiet_and_finite(monkeypatch, quiet, fast, scale, transpose, called):
    monkeypatch.setattr(ddp, "_TENSOR", [torch.Tensor])
    rec, grads = _Rec(), _Grads(quiet, fast)
    info = {"g": "0", "bwd": 4, "fwd": 5, "grads": grads}
    _backward(rec, info, scale, transpose)
    assert bool(grads.calls) == called and rec.errors == []
    if called:
        assert grads.calls[0][:2] == (5, 9)
    assert info["bwd"] == 5 and info["fwd_at_bwd"] == 5 and rec.inflight == {}
    assert rec.lines and rec.lines[0].startswith(b'{"t":"c","op":"ddp_backward","g":"0","s":1,"ts":')
    assert rec.lines[0].endswith(b',"site":9,"step":5}\n')


@pytest.mark.parametrize("group,first_seq", [("0", 0), ("grüppe", 0), ("7", 2**64)])
def test_record_is_the_python_hooks(monkeypatch, group, first_seq):
    """The record formatted in C (ASCII group, ints of a long long) or the general way (others),
    byte for byte what ddp._BackwardHook writes; its times from the same clock."""
    import json
    import time

    monkeypatch.setattr(ddp, "_TENSOR", [torch.Tensor])
    lines = {}
    for kind, make in (("c", native.hook), ("python", ddp._BackwardHook)):
        rec = _Rec()
        rec.t0_ns = time.perf_counter_ns()
        rec.seq = {group: first_seq}
        before = (time.perf_counter_ns() - rec.t0_ns) // 1000
        x = torch.ones(3, requires_grad=True)
        out = x * 2
        ddp._hook_output(out, make(rec, {"g": group, "bwd": 2, "fwd": 3, "grads": None}, -1))
        out.sum().backward()
        after = (time.perf_counter_ns() - rec.t0_ns) // 1000
        (line,) = rec.lines
        line = line if isinstance(line, bytes) else line.encode()
        r = json.loads(line)
        assert before <= r["ts"] <= r["ts"] + r["d"] <= after
        lines[kind] = line.replace(f'"ts":{r["ts"]},"d":{r["d"]}'.encode(), b"T")
    assert lines["c"] == lines["python"]
    assert lines["c"].endswith(f'"s":{first_seq + 1},T,"site":-1,"step":3}}\n'.encode())


@pytest.mark.parametrize("kind", ["plain", "has_hooks", "leaf", "subclass"])
def test_attach_is_hook_output(monkeypatch, kind):
    """``attach`` hangs the C hook as ``_hook_output`` would: the short registration for a plain
    non-leaf tensor without hooks, else the public ``register_hook``; the user's hooks still run."""
    monkeypatch.setattr(ddp, "_TENSOR", [torch.Tensor])
    rec, seen = _Rec(), []

    class Sub(torch.Tensor):
        pass

    x = torch.ones(3, requires_grad=True)
    t = x if kind == "leaf" else (x * 2).as_subclass(Sub) if kind == "subclass" else x * 2
    if kind == "has_hooks":
        t.register_hook(lambda g: seen.append("user"))
    info = {"g": "0", "bwd": 0, "fwd": 1, "grads": None}
    native.attach(t, rec, info, 3)
    t.register_hook(lambda g: seen.append("after"))
    t.sum().backward()
    assert info["bwd"] == 1 and rec.inflight == {} and len(rec.lines) == 1 and rec.errors == []
    assert seen == (["user", "after"] if kind == "has_hooks" else ["after"])
    if kind == "plain":
        assert list(t._backward_hooks)[0] == ddp._HOOK_ID


def test_hook_fires_once_and_reports_its_own_errors(monkeypatch):
    monkeypatch.setattr(ddp, "_TENSOR", [torch.Tensor])
    rec = _Rec()
    info = {"g": "0", "bwd": 0, "fwd": 1, "grads": None}
    x = torch.ones(3, requires_grad=True)
    out = x * 2
    hook = native.hook(rec, info, 1)
    ddp._hook_output(out, hook)
    # called outside a backward: the engine refuses the callback, an internal error of ours
    assert hook(torch.ones(3)) is None and hook(torch.ones(3)) is None  # the second call: nothing
    assert info["bwd"] == 1 and hook.key is not None and len(rec.errors) == 1
    assert "backward" in str(rec.errors[0])
    broken = native.hook(rec, {"g": "0"}, 1)  # no "bwd": an internal error, never the program's
    assert broken(torch.ones(1)) is None and isinstance(rec.errors[1], KeyError)


class _Module:
    """What the forward's end reads of a DDP module."""

    def __init__(self, sync: bool, rebuilt) -> None:
        self.require_backward_grad_sync = sync
        if rebuilt is not None:
            self._has_rebuilt_buckets = rebuilt


class _SeqRec(_Rec):
    def next_seq(self, g: str) -> int:
        self.seq[g] = self.seq.get(g, 0) + 1
        return self.seq[g]


@pytest.mark.parametrize("case", [
    dict(comm=False, grad=True, sync_bufs=False, rebuilt_before=True, rebuilt=True, sync=True, out="tensor"),
    dict(comm=True, grad=True, sync_bufs=True, rebuilt_before=True, rebuilt=True, sync=True, out="dict"),
    dict(comm=False, grad=True, sync_bufs=False, rebuilt_before=False, rebuilt=True, sync=True, out="tensor"),
    dict(comm=False, grad=False, sync_bufs=True, rebuilt_before=False, rebuilt=None, sync=True, out="tensor"),
    dict(comm=False, grad=True, sync_bufs=False, rebuilt_before=True, rebuilt=True, sync=False, out="tensor"),
    dict(comm=False, grad=True, sync_bufs=False, rebuilt_before=True, rebuilt=True, sync=True, out="nograd"),
    dict(comm=True, grad=True, sync_bufs=False, rebuilt_before=True, rebuilt=True, sync=True, out="tensor",
         group="grüppe"),
])
def test_forward_end_is_the_python_one(monkeypatch, case):
    """forward_end in C: the same record (byte for byte but its times), the same state, and the
    output hooked as ddp._forward_end_python does."""
    import json
    import time

    monkeypatch.setattr(ddp, "_TENSOR", [torch.Tensor])
    monkeypatch.setattr(ddp, "_attach", native.attach)
    got = {}
    for kind, end in (("c", native.forward_end), ("python", ddp._forward_end_python)):
        rec = _SeqRec()
        rec.t0_ns = time.perf_counter_ns()
        g = case.get("group", "0")
        rec.seq = {g: 4}
        info = {"g": g, "bwd": 2, "fwd": 3, "grads": None}
        x = torch.ones(3, requires_grad=case["out"] != "nograd")
        y = x * 2
        out = {"a": 1, "y": y} if case["out"] == "dict" else y
        mod = _Module(case["sync"], case["rebuilt"])
        seq = 5 if case["comm"] else 0
        before = (time.perf_counter_ns() - rec.t0_ns) // 1000
        end(mod, rec, info, out, case["comm"], seq, before, 7, case["sync_bufs"], case["grad"],
            case["rebuilt_before"])
        after = (time.perf_counter_ns() - rec.t0_ns) // 1000
        (line,) = rec.lines
        r = json.loads(line)
        assert r["ts"] == before and before + r["d"] <= after
        if y.requires_grad:
            y.sum().backward()
        got[kind] = (line.replace(f'"ts":{r["ts"]},"d":{r["d"]}'.encode(), b"T"), dict(info), dict(rec.seq), len(rec.lines),
                     rec.errors, rec._ddp_ptrs["dirty"])
    assert got["c"] == got["python"]
    hooked = case["grad"] and case["sync"] and case["out"] != "nograd"
    assert got["c"][3] == 1 + hooked and got["c"][4] == [] and got["c"][5] is True


class _FwdModule:
    """What the forward's set-up reads of a DDP module."""

    def __init__(self, bufs: bool, rebuilt) -> None:
        self.modules_buffers = [1] if bufs else []
        self.checked = 0
        if rebuilt is not None:
            self._has_rebuilt_buckets = rebuilt

    def _check_sync_bufs_pre_fwd(self) -> bool:
        self.checked += 1
        return True


def _call(fn, *args):
    return fn(*args)  # the "wrapper": the site is its caller's line


@pytest.mark.parametrize("bufs,rebuilt,bwd,grad", [
    (False, True, 0, True), (True, True, 0, True), (False, False, 2, True), (False, False, 2, False),
    (False, None, 0, True), (False, False, 0, True),
])
def test_forward_begin_is_the_python_one(bufs, rebuilt, bwd, grad):
    from ddpdoctor.rank.callsite import SiteTable

    got = {}
    for kind, begin in (("c", native.forward_begin), ("python", ddp._forward_begin_python)):
        rec = _SeqRec()
        rec.sites = SiteTable(lambda r: None)
        rec.seq = {"0": 2}
        info = {"g": "0", "bwd": bwd, "fkey": ("ddp_fwd", 1)}
        mod = _FwdModule(bufs, rebuilt)
        sites = []
        with torch.set_grad_enabled(grad):
            for _ in range(2):  # a new site, then the same one (the C key's hit)
                res = _call(begin, mod, rec, info)
                sites.append(res[3])
        comm, seq, start, site, sync_bufs, grad_on, rebuilt_before, gname, fkey = res
        got[kind] = (comm, seq, site, sync_bufs, grad_on, rebuilt_before, gname, fkey, mod.checked, dict(rec.seq),
                     {k: v[:4] for k, v in rec.inflight.items()}, sites[0] == sites[1])
    assert got["c"] == got["python"]
    assert got["c"][-1] is True and got["c"][0] == (bufs or (grad and rebuilt is False and bwd > 0))
