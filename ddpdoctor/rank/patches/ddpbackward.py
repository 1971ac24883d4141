"""The end of a DDP backward, taken where the backward call returns.

A DDP backward event ends when DDP has waited for its gradient all-reduce: after the
end-of-backward callback that DDP's reducer queues on the autograd engine. The output hook of
``ddp.py`` runs before that callback is queued, so it used to queue a callback that queued
another one (the second runs after DDP's): two ``queue_callback`` calls and two calls from the
engine back into Python per step, ~18k of the ~90k instructions the recording added to a small
DDP step (callgrind, issue #11). The engine runs those callbacks before
``torch.autograd.graph._engine_run_backward`` (what ``Tensor.backward``, ``torch.autograd.backward``
and ``torch.autograd.grad`` call) returns, so the same moment is seen, for a few hundred
instructions, by a wrapper of that function: the hook registers itself in ``PENDING`` and the
wrapper ends every hook registered during its own call, once the engine has returned.

The wrapper is installed when the first DDP module is constructed (a program without DDP pays
nothing). The hook takes this way only when exactly one wrapped backward call is in flight
(one entry in ``STACK``); otherwise (a backward issued straight to the engine, a reentrant backward
inside another, backward calls in two threads at once) it keeps the engine callbacks, which are
exact in every case. A backward that raises ends no event (the engine runs no callback then
either); its in-flight entry is removed at once.
"""

from __future__ import annotations

import functools

from . import WRAPPED

#: One entry per wrapped backward call in flight, in all threads: how many hooks were pending
#: when it started (a list, not a counter: an append and a pop are cheaper bytecode).
STACK: list = []
#: Hooks whose backward ends when the wrapped call that was in flight when they fired returns.
PENDING: list = []


def install() -> None:
    """Wrap ``_engine_run_backward`` under both names torch calls it by (idempotent)."""
    import torch.autograd as autograd
    from torch.autograd import graph

    orig = getattr(graph, "_engine_run_backward", None)
    if orig is None or getattr(orig, WRAPPED, False):
        return
    wrapper = _wrap(orig)
    graph._engine_run_backward = wrapper
    if getattr(autograd, "_engine_run_backward", None) is orig:
        autograd._engine_run_backward = wrapper


def _wrap(orig):
    stack, pending = STACK, PENDING

    @functools.wraps(orig)
    def _engine_run_backward(*args, **kwargs):
        stack.append(len(pending))
        try:
            out = orig(*args, **kwargs)
        except BaseException:
            n = stack.pop()
            if len(pending) > n:
                _finish(n, False)
            raise
        n = stack.pop()
        k = len(pending) - n
        if k:
            if k == 1:  # the common case: one DDP module
                pending.pop()._done()
            else:
                _finish(n, True)
        return out

    setattr(_engine_run_backward, WRAPPED, True)
    return _engine_run_backward


def _finish(n: int, ok: bool) -> None:
    """End the hooks registered during the call that saw ``n`` pending ones at its start."""
    hooks = PENDING[n:]
    del PENDING[n:]
    for h in hooks:
        if ok:
            h._done()
        else:
            h._abandon()
