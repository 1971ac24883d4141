"""Which parameters received gradients on which ranks, for divergent-parameter-use (DD016).

With ``find_unused_parameters=True`` DDP's reducer keeps a "used" map (one int32 per parameter)
that it all-reduces after each backward, so that a parameter no rank used is left alone. After
the reduction each entry counts the ranks that used the parameter: every rank can see, with no
communication of ours, whether some parameter was used on some ranks only (an entry strictly
between 0 and the world size), which is when DDP silently averages zeros from the other ranks.
Per backward this is two reads of that small tensor from autograd-engine callbacks: one before
DDP's end-of-backward callback (the map still holds this rank's own use: kept as bytes, no
analysis) and one after it (the counts; compared with the last map seen, a NumPy test only when
it changed). A ``grad_used`` record is written only for a step where the counts are partial (at
most ``CAP`` per module, then counted), with the parameter names, the counts, this rank's own
use when the first read was not overtaken by the reduction, and where the owning modules'
``forward`` is defined (for the condition that decided). On an accelerator the map lives on the
device: it is read on the first ``FIRST`` backward passes and every ``EVERY``-th one after.
Models without ``find_unused_parameters`` (or with ``static_graph``) cost nothing here: every
parameter gets a gradient on every rank there, or DDP fails by itself.
"""

from __future__ import annotations

import os
import weakref

#: Partial steps recorded per DDP module before only counting them.
CAP = 10
#: Accelerator maps: the first backward passes read, then every EVERY-th.
FIRST = 3
EVERY = max(1, int(os.environ.get("DDPDOCTOR_PARAMUSE_EVERY", "100") or 100))


def attach(rec, idx: int, ddp):
    """A :class:`Used` for a DDP module that tracks unused parameters, else None."""
    if not getattr(ddp, "find_unused_parameters", False) or getattr(ddp, "static_graph", False):
        return None
    reducer = getattr(ddp, "reducer", None)
    if reducer is None or not hasattr(reducer, "_get_local_used_map"):
        return None
    try:
        world = int(ddp.process_group.size())
    except Exception:
        return None
    if world < 2:
        return None
    return Used(rec, idx, ddp, world)


def _reducer_names(ddp) -> list[str]:
    """Parameter names in the reducer's order (``DistributedDataParallel._build_params_for_reducer``:
    modules in ``named_modules`` order, their own trainable parameters, shared ones once)."""
    ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    seen: set[int] = set()
    out = []
    for mname, mod in ddp.module.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if not p.requires_grad or full in ignore or id(p) in seen:
                continue
            seen.add(id(p))
            out.append(full)
    return out


def _library(file: str) -> bool:
    return "site-packages" in file or "dist-packages" in file or file.startswith("<")


class Used:
    """Per DDP module with ``find_unused_parameters=True``: the used-map reads of each backward."""

    def __init__(self, rec, idx: int, ddp, world: int) -> None:
        import torch

        self.rec, self.idx, self.world = rec, idx, world
        self.ref = weakref.ref(ddp)
        self.names = _reducer_names(ddp)
        self.engine = torch.autograd.Variable._execution_engine
        self.cur = (0, None)
        self.mine: bytes | None = None
        self.clean: bytes | None = None  # the last map seen with no partial entry
        self.partial = 0
        self.steps = 0
        self.where_done = False
        self.on_cpu: bool | None = None

    def on_backward(self, step: int, site) -> None:
        ddp = self.ref()
        if ddp is None:
            return
        self.steps += 1
        if self.on_cpu is None:
            self.on_cpu = ddp.reducer._get_local_used_map().device.type == "cpu"
        if not self.on_cpu and not (step <= FIRST or step % EVERY == 0):
            return
        self.cur = (step, site)
        self.engine.queue_callback(self._before_reduction)

    def _map(self) -> bytes | None:
        ddp = self.ref()
        if ddp is None:
            return None
        m = ddp.reducer._get_local_used_map()
        if m.device.type != "cpu":
            m = m.cpu()
        return m.numpy().tobytes()

    def _before_reduction(self) -> None:
        try:
            self.mine = self._map()
            self.engine.queue_callback(self._after_reduction)
        except Exception as exc:
            self.rec.internal_error(exc)

    def _after_reduction(self) -> None:
        try:
            counts = self._map()
            if counts is None or counts == self.clean:
                return
            import numpy as np

            c = np.frombuffer(counts, dtype=np.int32)
            part = np.nonzero((c != 0) & (c != self.world))[0]
            if not len(part):
                self.clean = counts
                return
            self.partial += 1
            if self.partial <= CAP:
                self._record(c, part)
        except Exception as exc:
            self.rec.internal_error(exc)

    def _record(self, c, part) -> None:
        import numpy as np

        rec = self.rec
        if rec.writer is None or not rec.enabled:
            return
        step, site = self.cur
        idx = [int(i) for i in part[:40]]
        out = {"t": "grad_used", "id": self.idx, "step": step, "world": self.world,
               "names": [self.names[i] if i < len(self.names) else f"#{i}" for i in idx],
               "cnt": [int(c[i]) for i in idx], "ts": rec.now_us(), "site": site}
        if len(part) > 40:
            out["more"] = int(len(part) - 40)
        if self.mine is not None and len(self.mine) == len(c) * 4:
            mine = np.frombuffer(self.mine, dtype=np.int32)
            if int(mine.max(initial=0)) <= 1:  # else the reduction overtook the first read
                out["mine"] = [int(mine[i]) for i in idx]
        if not self.where_done:
            self.where_done = True
            out["fwd"] = self._forwards(out["names"])
        rec.emit(out)

    def _forwards(self, names: list[str]) -> list[list]:
        """Where the ``forward`` of the modules owning the partial parameters (and of their
        parents, up to 3 levels) is defined: ``[module path, file, first line, child attribute]``."""
        ddp = self.ref()
        if ddp is None:
            return []
        mods = dict(ddp.module.named_modules())
        out: list[list] = []
        seen: set[tuple] = set()
        for name in names:
            path = name.rsplit(".", 1)[0] if "." in name else ""
            child = ""
            for _ in range(4):
                if (path, child) not in seen and path in mods:
                    seen.add((path, child))
                    code = getattr(getattr(type(mods[path]), "forward", None), "__code__", None)
                    if code is not None and not _library(code.co_filename):
                        out.append([path, code.co_filename, code.co_firstlineno, child])
                if not path:
                    break
                path, _, child = path.rpartition(".")
            if len(out) >= 8:
                break
        return out

    def at_exit(self) -> None:
        if self.partial:
            rec = self.rec
            if rec.writer is not None and rec.enabled:
                rec.emit({"t": "grad_used", "id": self.idx, "at": "exit", "steps": self.partial,
                          "of": self.steps, "ts": rec.now_us(), "site": -1})
