"""The optimizer step hooks of the recording (rank/patches/stephooks.py) and what hangs on them:
one post hook per optimizer counts steps and calls the replica digests when due, a first-step
pre hook goes away after the first step, and grads.py's global pre hook is armed only while a
non-finite backward awaits its step. In one process, without a process group."""

from __future__ import annotations

import torch
from support.fakerec import FakeRecorder

from ddpdoctor.rank.patches import grads, replicas, stephooks


def _opt():
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return net, opt


def _step(net, opt) -> None:
    opt.zero_grad()
    net(torch.ones(4, 3)).sum().backward()
    opt.step()


def test_first_step_hook_runs_once_and_steps_are_counted(monkeypatch):
    seen = []
    monkeypatch.setattr(stephooks.HOOKS, "first_step", seen.append)
    net, opt = _opt()
    stephooks.on_optimizer(opt)
    user = []
    opt.register_step_pre_hook(lambda o, a, k: user.append(1))  # after ours: must keep running
    before = stephooks.STEPS[0]
    for _ in range(4):
        _step(net, opt)
    assert seen == [opt]
    assert len(user) == 4
    assert stephooks.STEPS[0] - before == 4
    assert len(opt._optimizer_step_pre_hooks) == 1  # ours was removed after the first step


class _Rec:
    writer = object()
    enabled = True

    def internal_error(self, exc: BaseException) -> None:
        raise exc


def test_replica_digests_follow_the_schedule(monkeypatch):
    net, opt = _opt()
    ddp = type("FakeDDP", (), {})()
    ddp.module = net
    rep = replicas._Replica(0, ddp)
    digests: list[int] = []
    monkeypatch.setattr(replicas, "_rec", lambda: _Rec())
    monkeypatch.setattr(replicas, "_digest", lambda rec, r, at, extra=None: digests.append(r.steps))
    monkeypatch.setitem(replicas._state, "mods", [rep])
    monkeypatch.setattr(stephooks.HOOKS, "modules_of", lambda o: (rep,) if o is opt else ())
    monkeypatch.setattr(stephooks.HOOKS, "after_step", replicas.after_step)
    calls = []
    orig = replicas.after_step
    monkeypatch.setattr(stephooks.HOOKS, "after_step", lambda r: (calls.append(r.steps), orig(r)))
    stephooks.on_optimizer(opt)
    for _ in range(2 * replicas.EVERY + 1):
        _step(net, opt)
    expected = [1, 2, 3, replicas.EVERY, 2 * replicas.EVERY]
    assert digests == expected
    assert calls == expected  # the hook calls into replicas only when a digest is due


def test_a_new_ddp_module_makes_optimizers_look_again(monkeypatch):
    net, opt = _opt()
    found = []
    monkeypatch.setattr(stephooks.HOOKS, "modules_of", lambda o: found.append(o) or ())
    stephooks.on_optimizer(opt)
    _step(net, opt)
    _step(net, opt)
    assert found == [opt]
    stephooks.new_ddp_module()
    _step(net, opt)
    assert found == [opt, opt]


def test_the_nonfinite_step_hook_is_armed_only_while_a_backward_awaits_its_step():
    rec = FakeRecorder(raise_errors=True)
    net, opt = _opt()
    ddp = type("FakeDDP", (), {})()
    ddp.module = net
    g = grads._Grads(rec, 0, ddp)
    grads._state["mods"].append(g)
    grads._state["opt"].clear()
    try:
        for step in (1, 2):
            g(torch.ones(4, 2), step, 5)
        assert grads._state["hook"] is None and g.quiet
        g(torch.full((4, 2), float("nan")), 3, 5)
        assert grads._state["hook"] is not None and not g.quiet
        net.weight.grad = torch.zeros_like(net.weight)
        net.bias.grad = torch.zeros_like(net.bias)
        opt.step()  # through the armed global hook: the pending backward is settled
        assert [(r["at"], r["step"]) for r in rec.out] == [("local", 3), ("skip", 3)]
        assert rec.out[-1]["how"] == "finite"
        g(torch.ones(4, 2), 4, 5)  # the next backward disarms the hook
        assert grads._state["hook"] is None and g.quiet
    finally:
        grads._state["mods"].remove(g)
        grads._state["opt"].clear()
        grads._disarm_if_idle()
