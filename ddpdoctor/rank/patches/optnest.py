"""Which optimizer step is the outermost one.

Wrapping optimizers (``ZeroRedundancyOptimizer``, ``PostLocalSGDOptimizer``, Lookahead-style
wrappers) run an inner optimizer's ``step`` inside their own, and torch's global step hooks fire
for both. ZeRO's inner step updates this rank's shard only, before the wrapper broadcasts every
shard: the parameters seen there differ across ranks by design. Hooks that look at the state a
step leaves behind ask ``outermost`` and act at the wrapper's step only.
"""

from __future__ import annotations

#: Optimizers whose step is running, outermost first (one process: steps are not concurrent).
_running: list = []
_installed = [False]


def _before(opt, args, kwargs) -> None:
    for i, o in enumerate(_running):
        if o is opt:  # a step cannot run inside itself: these were left by a step that raised
            del _running[i:]
            break
    _running.append(opt)


def install() -> None:
    """Follow step nesting from now on (once per process; a no-op on a torch without hooks)."""
    if _installed[0]:
        return
    _installed[0] = True
    try:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
    except ImportError:
        return
    register_optimizer_step_pre_hook(_before)


def outermost(opt) -> bool:
    """Called from a step post-hook: ends ``opt``'s step; True when no other step encloses it."""
    for i in range(len(_running) - 1, -1, -1):
        if _running[i] is opt:
            del _running[i:]
            break
    return not _running
