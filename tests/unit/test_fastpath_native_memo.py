"""The session-5 mechanisms of the C repeat-call path (ddpdoctor/rank/_fastcall.c): the memo of
the last Hits found per call site (a call whose arguments differ in anything the record depends
on still reaches the general path), the attribute reads and writes through a plain object's
instance dict (a state change, or a descriptor added to the class later, is still seen), and
the `is_cpu or device` term of the argument key."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ddpdoctor.rank._fastcall", reason="C extension not built (no compiler)")

from test_fastpath_native import _build, _Rec  # noqa: E402

from ddpdoctor.rank.patches import fastpath  # noqa: E402


def _calls(orig_log: list):
    def orig(tensor, op="SUM", group=None, async_op=False):
        orig_log.append(tuple(tensor.shape))
    return orig


def _shape_of_key(key) -> tuple:
    return tuple(key[4])  # (code, lasti, caller's lasti, n, shape, dtype, is_cpu or device...)


@pytest.mark.parametrize("use_native", [False, True])
def test_shape_change_at_the_same_site_reaches_the_general_path(use_native, monkeypatch):
    log: list = []
    w, rec, _, _ = _build(use_native, monkeypatch, _calls(log))
    shapes = [(1,)] * 5 + [(2,)] * 3 + [(1,)] * 2 + [(300,)] * 3 + [(300, 2)] + [(300,)]
    for s in shapes:
        w(torch.ones(s))  # one call site for all of them
    assert log == shapes  # every call issued, once, with its own tensor
    # one general call per new shape; the repeats (memo or dict) record from their Hit
    assert [_shape_of_key(k[0]) for k in rec.keys] == [(1,), (2,), (300,), (300, 2)]
    assert all(a == b for a, b in rec.keys)
    assert rec.events == len(shapes) - 4 and rec.seq == {"0": len(shapes) - 4}


@pytest.mark.parametrize("use_native", [False, True])
def test_dtype_and_group_changes_reach_the_general_path(use_native, monkeypatch):
    log: list = []
    w, rec, _, _ = _build(use_native, monkeypatch, _calls(log))
    g1, g2 = object(), object()
    for t, g in [(torch.ones(1), g1), (torch.ones(1), g1), (torch.ones(1, dtype=torch.float64), g1),
                 (torch.ones(1, dtype=torch.float64), g1), (torch.ones(1), g2), (torch.ones(1), g2),
                 (torch.ones(1), g1)]:
        w(t, "SUM", g)
    assert rec.general_calls == 3 and len(log) == 7
    assert [(k[0][5], k[0][7]) for k in rec.keys] == [(torch.float32, g1), (torch.float64, g1),
                                                      (torch.float32, g2)]


def test_memo_does_not_outlive_its_recorder(monkeypatch):
    w, rec, _, _ = _build(True, monkeypatch, _calls([]))
    for _ in range(3):
        w(torch.ones(1))
    assert rec.general_calls == 1 and rec.events == 2
    rec2 = _Rec()  # a new recorder: its site ids are its own, so a Hit of the old one is no use
    rec2.keys = []
    fastpath.recorder_mod._recorder = rec2
    w(torch.ones(1))
    assert rec2.general_calls == 1 and rec.general_calls == 1 and rec.events == 2


def test_recorder_state_changes_are_seen_by_the_c_path(monkeypatch):
    log: list = []
    w, rec, _, _ = _build(True, monkeypatch, _calls(log))
    seen: list = []
    counted: list = []
    mapped = rec.writer.mm

    def disable():
        rec.enabled = False

    def enable_without_slot():
        rec.enabled = True
        rec.slot = None

    def other_writer():
        rec.writer = types.SimpleNamespace(mm=types.SimpleNamespace(write=seen.append))

    def property_on_class():
        # a descriptor added to the class afterwards: the attribute is no longer the dict's entry
        type(rec).events = property(lambda self: 100, lambda self, v: counted.append(v))

    def remove_property():
        del type(rec).events

    steps = [None, None, None, disable, enable_without_slot, other_writer, property_on_class,
             remove_property]
    events = []
    try:
        for step in steps:  # one call site: every call after the first is a repeat call
            if step is not None:
                step()
            w(torch.ones(1))
            events.append(rec.events)
    finally:
        if "events" in type(rec).__dict__:
            del type(rec).events
    assert len(log) == len(steps) and rec.general_calls == 1
    assert events == [0, 1, 2, 2, 3, 4, 100, 5]
    assert counted == [101]  # rec.events += 1 went through the property
    assert len(mapped.data) == 3 and len(seen) == 3 and seen[0].startswith(b'{"t":"c"')


def test_cpu_tensor_key_term_is_is_cpu():
    params, defaults = ["tensor", "op", "group", "async_op"], {"op": "SUM", "group": None, "async_op": False}
    key = fastpath.key_function(params, defaults, ("tensor",), ("group", "op", "async_op"), 99)
    k = key((torch.ones(2, 3),), {}, 1, 2, 3)
    assert k[4:7] == (torch.Size([2, 3]), torch.float32, True)
    meta = key((torch.ones(2, 3, device="meta"),), {}, 1, 2, 3)
    assert meta[6] == torch.device("meta") and meta != k


def test_depth_in_c_is_per_thread_and_seen_by_the_c_path(monkeypatch):
    import threading

    from ddpdoctor.rank import recorder

    if type(recorder._ThreadState.__dict__["depth"]).__name__ != "Depth":
        pytest.skip("DDPDOCTOR_NATIVE=0: depth stays in the threading.local")
    log: list = []
    w, rec, _, _ = _build(True, monkeypatch, _calls(log))
    rec.local = recorder._ThreadState()
    other: list = []
    for depth in [0, 0, 1, 2, 0]:  # one call site: repeat calls after the first
        rec.local.depth = depth
        th = threading.Thread(target=lambda: other.append(rec.local.depth))
        th.start()
        th.join(timeout=30)
        w(torch.ones(1))
    assert len(log) == 5 and rec.general_calls == 1 and rec.events == 2  # nested: not recorded
    assert other == [0] * 5  # another thread's depth is its own
    rec.local.depth += 3
    assert rec.local.depth == 3 and getattr(rec.local, "depth", 0) == 3
    rec.local.depth = 0
    with pytest.raises(TypeError):
        rec.local.depth = "x"


def test_depth_stays_python_with_native_off():
    env = dict(os.environ, DDPDOCTOR_NATIVE="0")
    code = "from ddpdoctor.rank import recorder; print(recorder._ThreadState.__dict__['depth'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "0", out.stderr


@pytest.mark.parametrize("use_native", [False, True])
def test_op_is_keyed_by_identity_in_the_memo_too(use_native, monkeypatch):
    log: list = []
    w, rec, _, _ = _build(use_native, monkeypatch, _calls(log))
    a, b = int("123456789"), int("123456789")  # equal, not the same object: two keys
    assert a == b and a is not b
    for op in [a, a, b, b, a]:
        w(torch.ones(1), op)
    assert len(log) == 5 and rec.general_calls == 2 and rec.events == 3


def test_plan_covers_every_positional_count_of_the_signature():
    # barrier(group, async_op, device_ids, timeout): the shim passes all four; device_ids and
    # timeout do not change the record, so the key leaves them out at every count
    params = ["group", "async_op", "device_ids", "timeout"]
    defaults = {"group": None, "async_op": False, "device_ids": None, "timeout": None}
    key = fastpath.key_function(params, defaults, (), ("group", "async_op"), 99)
    assert len(key.plan) == 5 and key.plan[4] == ((0, 2), (1, 2))
    g = object()
    assert key((g, False, None, None), {}, 1, 2, 3) == (1, 2, 3, 4, g, False)
    assert key((g, False, [0], 5), {}, 1, 2, 3) == (1, 2, 3, 4, g, False)
