"""The optimizer step hooks of the silent-bug recording: one post hook per optimizer.

Four checks look at optimizer steps: each optimizer's first step (``data.py``: the parameters
and gradients it starts from), the number of steps taken during a DataLoader pass
(``coverage.py``), replica digests on schedule (``replicas.py``) and what became of a non-finite
backward (``grads.py``). As four process-global hooks that was four Python calls per step, each
finding its per-optimizer state in a weak dictionary: ~115 bytecodes, ~20k instructions of a
~1.5M-instruction DDP step (callgrind, issue #11). Here each optimizer gets, when it is
constructed (``data.py`` wraps ``Optimizer.__init__``), one post hook that holds its own state,
and a pre hook for its first step only, which the post hook removes (not the pre hook itself:
torch iterates the pre-hook dict while calling it, and removing an entry then would raise for a
hook registered after ours). ``grads.py`` adds a global pre hook only while a non-finite backward
awaits its optimizer step.
"""

from __future__ import annotations

import sys

from .. import native

#: Optimizer steps taken in this process (``coverage.py``: steps during a pass).
STEPS = [0]
#: Bumped when a DDP module is constructed: each optimizer then recomputes the modules it updates.
GEN = [0]


class _Hooks:
    """What the features plug in when they are imported (they import this module, never the
    other way round): ``first_step(opt)`` (data.py), ``modules_of(opt)`` and ``after_step(rep)``
    (replicas.py)."""

    first_step = None
    modules_of = None
    after_step = None


HOOKS = _Hooks()


class _Post:
    """An optimizer's step post hook: counts the step and tells ``replicas`` when a digest is due.

    Per step, the common path is a counter, a generation test and, per DDP module the optimizer
    updates, its step count compared with the next step due: no dictionary lookup, no call."""

    __slots__ = ("first", "gen", "reps")

    def __init__(self, first) -> None:
        self.first = first  # the handle of the first-step pre hook, until that step is over
        self.gen = -1
        self.reps: tuple = ()

    def __call__(self, opt, args, kwargs) -> None:
        STEPS[0] += 1
        if self.gen != GEN[0]:
            try:
                self._refresh(opt)
            except Exception:  # never break the program's step; its digests are not taken
                self.reps = ()
        for rep in self.reps:
            rep.steps = n = rep.steps + 1
            if n >= rep.due:  # a digest is due, or accelerator copies are pending (replicas.py)
                HOOKS.after_step(rep)

    def _refresh(self, opt) -> None:
        self.gen = GEN[0]
        first, self.first = self.first, None
        if first is not None:
            first.remove()  # the pre-hook loop is over: safe to change its dict now
        modules_of = HOOKS.modules_of
        self.reps = modules_of(opt) if modules_of is not None else ()


def _refresh_reps(first, opt) -> tuple:
    """The C post hook's rare path (``_Post._refresh``): the first-step pre hook removed, the DDP
    modules ``opt`` updates looked up again."""
    if first is not None:
        first.remove()  # the pre-hook loop is over: safe to change its dict now
    modules_of = HOOKS.modules_of
    return tuple(modules_of(opt)) if modules_of is not None else ()


_native = native.load("_ddpstep")
if _native is not None:
    _native.step_setup(STEPS, GEN, HOOKS, _refresh_reps)
#: ``_Post``, or its C twin (rank/_ddpstep.c: no Python frame per optimizer step, ~40 bytecodes,
#: issue #11) where the extension is built and on.
_new_post = _native.post if _native is not None else _Post


def _first_step(opt, args, kwargs) -> None:
    """An optimizer's first step, before it runs (``data.py`` records what it starts from)."""
    first_step = HOOKS.first_step
    if first_step is not None:
        first_step(opt)


def made_by_optimizer(opt, depth: int = 40) -> bool:
    """Whether ``opt`` was constructed by another optimizer's code (a method of it is on the
    stack): the inner optimizer of a wrapper. ``ZeroRedundancyOptimizer`` builds one over this
    rank's shard and steps it inside its own step, before it broadcasts the shards: the
    parameters after the inner step differ across ranks by design, so only the wrapper's steps
    are followed. Once per optimizer, at construction."""
    try:
        from torch.optim import Optimizer

        frame = sys._getframe(1)
    except Exception:
        return False
    while frame is not None and depth > 0:
        try:
            owner = frame.f_locals.get("self")
        except Exception:
            owner = None
        if owner is not None and owner is not opt and isinstance(owner, Optimizer):
            return True
        frame = frame.f_back
        depth -= 1
    return False


def on_optimizer(opt) -> None:
    """A ``torch.optim.Optimizer`` was constructed: hook its steps (never raises). The inner
    optimizer of a wrapper (``made_by_optimizer``) is left to the wrapper's hooks."""
    if made_by_optimizer(opt):
        return
    try:
        pre = opt.register_step_pre_hook(_first_step)
        opt.register_step_post_hook(_new_post(pre))
    except Exception:  # an optimizer without torch's hook registry: its steps are not followed
        pass


def new_ddp_module() -> None:
    """A DDP module was constructed: optimizers recompute which modules they update."""
    GEN[0] += 1
