"""stephooks.made_by_optimizer: a wrapper's inner optimizer is told apart (real torch optimizers)."""

from __future__ import annotations

import torch

from ddpdoctor.rank.patches.stephooks import made_by_optimizer


class _Wrapper(torch.optim.Optimizer):
    """Builds and steps an inner SGD over its parameters, like ZeroRedundancyOptimizer."""

    def __init__(self, params):
        params = list(params)
        super().__init__(params, {})
        self.seen_inner = None
        self.inner = self._build(params)

    def _build(self, params):
        inner = torch.optim.SGD(params, lr=0.1)
        self.seen_inner = made_by_optimizer(inner)
        return inner

    def step(self, closure=None):
        self.inner.step()


def test_inner_optimizer_is_made_by_another_and_plain_ones_are_not():
    p = torch.nn.Parameter(torch.ones(2))
    wrapper = _Wrapper([p])
    assert wrapper.seen_inner is True
    assert made_by_optimizer(wrapper) is False  # constructed by the test, not by an optimizer
    plain = torch.optim.SGD([p], lr=0.1)
    assert made_by_optimizer(plain) is False

    def factory():  # a helper function that builds optimizers is no optimizer
        return torch.optim.Adam([p])

    assert made_by_optimizer(factory()) is False
