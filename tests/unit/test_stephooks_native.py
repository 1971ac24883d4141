"""stephooks' post hook in C (rank/_ddpstep.c ``post``) does what ``stephooks._Post`` does: the
step count, the modules looked up again when a DDP module was made, the first-step pre hook
removed, ``after_step`` when a replica's digest is due, and a failing lookup never breaks the
step. Real torch optimizers."""

from __future__ import annotations

import pytest
import torch

from ddpdoctor.rank.patches import stephooks

if stephooks._native is None:
    pytest.skip("rank/_ddpstep.c not built (or DDPDOCTOR_NATIVE=0)", allow_module_level=True)


class _Rep:
    def __init__(self, due: int) -> None:
        self.steps, self.due = 0, due


def _drive(make, monkeypatch, fail: bool = False) -> tuple:
    reps = [_Rep(2), _Rep(3)]
    due: list = []
    lookups: list = []
    stephooks.STEPS[0] = 0

    def modules_of(opt):
        lookups.append(1)
        if fail:
            raise RuntimeError("lookup failed")
        return list(reps)

    def after_step(rep):
        due.append((reps.index(rep), rep.steps))
        rep.due = rep.steps + 2

    monkeypatch.setattr(stephooks.HOOKS, "modules_of", modules_of)
    monkeypatch.setattr(stephooks.HOOKS, "after_step", after_step)
    firsts: list = []
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    pre = opt.register_step_pre_hook(lambda o, a, k: firsts.append(1))
    opt.register_step_post_hook(make(pre))
    for i in range(6):
        if i == 3:
            stephooks.new_ddp_module()  # the optimizer looks its modules up again
        p.grad = torch.ones(2)
        opt.step()
    return stephooks.STEPS[0], [r.steps for r in reps], due, len(lookups), firsts, p.detach().tolist()


@pytest.fixture
def _restored():
    saved = stephooks.STEPS[0], stephooks.GEN[0]
    yield
    stephooks.STEPS[0], stephooks.GEN[0] = saved


@pytest.mark.parametrize("fail", [False, True])
def test_c_post_hook_is_the_python_one(monkeypatch, fail, _restored):
    c = _drive(stephooks._native.post, monkeypatch, fail)
    py = _drive(stephooks._Post, monkeypatch, fail)
    assert c == py
    steps, counts, due, lookups, firsts, _ = c
    assert steps == 6 and lookups == 2 and firsts == [1]  # first-step pre hook removed after step 1
    assert counts == ([0, 0] if fail else [6, 6]) and (due == [] if fail else due[:2] == [(0, 2), (1, 3)])


@pytest.mark.parametrize("make", ["c", "python"])
def test_c_post_hook_leaves_an_optimizer_collectable(monkeypatch, _restored, make):
    """The C post hook is tracked by the garbage collector: an optimizer in a reference cycle
    with its hooks is freed as with the Python one."""
    import gc
    import weakref

    monkeypatch.setattr(stephooks.HOOKS, "first_step", None)
    monkeypatch.setattr(stephooks.HOOKS, "modules_of", None)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    pre = opt.register_step_pre_hook(stephooks._first_step)
    opt.register_step_post_hook(stephooks._native.post(pre) if make == "c" else stephooks._Post(pre))
    opt.cycle = opt
    p.grad = torch.ones(2)
    opt.step()
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
