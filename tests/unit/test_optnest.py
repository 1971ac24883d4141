"""optnest: a wrapping optimizer's inner step is not the outermost one (real torch optimizers)."""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ddpdoctor.rank.patches import optnest


class _Wrapper(torch.optim.Optimizer):
    """Steps an inner SGD inside its own step, like ZeroRedundancyOptimizer does."""

    def __init__(self, params, fail: bool = False):
        params = list(params)
        super().__init__(params, {})
        self.inner = torch.optim.SGD(params, lr=0.1)
        self.fail = fail

    def step(self, closure=None):
        self.inner.step()
        if self.fail:
            raise RuntimeError("wrapper failed after its inner step")


def test_inner_step_is_not_outermost_and_a_failed_step_leaves_nothing_behind():
    optnest.install()
    seen: list = []
    handle = register_optimizer_step_post_hook(lambda opt, a, k: seen.append((type(opt).__name__, optnest.outermost(opt))))
    try:
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        wrapper = _Wrapper([p])
        wrapper.step()
        assert seen == [("SGD", False), ("_Wrapper", True)]
        seen.clear()
        plain = torch.optim.SGD([p], lr=0.1)
        plain.step()
        assert seen == [("SGD", True)]
        seen.clear()
        wrapper.fail = True  # raises: its post-hooks never run, its entries stay behind
        try:
            wrapper.step()
        except RuntimeError:
            pass
        wrapper.fail = False
        wrapper.step()  # the stale entries are dropped when the same optimizer steps again
        plain.step()
        assert seen == [("SGD", False), ("SGD", False), ("_Wrapper", True), ("SGD", True)]
    finally:
        handle.remove()
