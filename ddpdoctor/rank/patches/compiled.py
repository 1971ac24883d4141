"""``torch.compile`` meets ddpdoctor's Python wrappers.

Dynamo traces every Python frame it does not skip, and it skips torch's own files. torch's
``DistributedDataParallel.forward`` is therefore run eagerly and the module inside it compiled;
our wrapper of that forward lives outside torch, so a compiled DDP model had dynamo inline the
wrapper's bookkeeping (thread-locals, dicts, the trace file): an assertion inside dynamo, a
"cannot trace object.__hash__" warning in the user's output, and the DDP events lost. Marked
with ``torch._dynamo.disable(recursive=False)``, the wrapper runs eagerly like torch's own forward
while everything it calls is still compiled.

A global module hook still registered when a compiled module is first called makes torch warn in
the user's output (``pyrng``'s set-up window uses one), so the window closes at ``torch.compile``.

Nothing here runs unless the program compiles: ``torch._dynamo`` is imported by the program's
own ``torch.compile`` call, never by ddpdoctor before it (its import takes about a second).
``Module.compile`` calls ``torch.compile`` too.
"""

from __future__ import annotations

import functools
import sys

from . import WRAPPED

#: Called (without arguments) before each ``torch.compile`` call; each must be idempotent.
_before: list = []


def before_compile(fn) -> None:
    """Run ``fn()`` before the program's next (and every) ``torch.compile`` call."""
    _before.append(fn)


def patch() -> None:
    """Wrap ``torch.compile`` (once)."""
    import torch

    orig = getattr(torch, "compile", None)
    if orig is None or getattr(orig, WRAPPED, False):
        return

    @functools.wraps(orig)
    def compile(*args, **kwargs):
        for fn in list(_before):
            try:
                fn()
            except Exception as exc:  # never in the way of the user's compile
                print(f"ddpdoctor: internal error before torch.compile: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
        return orig(*args, **kwargs)

    setattr(compile, WRAPPED, True)
    torch.compile = compile


def run_eagerly(owner, name: str) -> None:
    """Have dynamo run ``owner.name`` (one of our wrappers) eagerly, and compile what it calls."""
    fn = owner.__dict__.get(name)
    if fn is None or not getattr(fn, WRAPPED, False) or getattr(fn, "_torchdynamo_disable", False):
        return
    import torch._dynamo

    new = torch._dynamo.disable(fn, recursive=False)
    setattr(new, WRAPPED, True)
    setattr(owner, name, new)
