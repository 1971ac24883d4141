"""DD003: a rank-guarded write of a path read by other ranks with no collective between."""

from __future__ import annotations

import ast
from typing import Iterator

from ..analysis.findings import Finding
from ..source.names import dotted
from ..source.taint import describe, is_heuristic
from ..source.units import Func
from .finding import loc, make
from .rulekit import (
    RuleFamily,
    argument,
    blocks_of,
    canon_of,
    has_p2p_or_sync,
    unparsed,
)


class FileRules(RuleFamily):
    """Files shared between ranks through the file system."""

    def rules(self) -> list:
        return [("DD003", self.missing_barrier, ("save", "open", "replace", "rename", "move", "copy"))]

    # -- DD003 -------------------------------------------------------------------------------------
    WRITES = {"torch.save": 1, "numpy.save": 0, "numpy.savez": 0, "torch.jit.save": 1, "os.replace": 1,
              "os.rename": 1, "shutil.move": 1, "shutil.copy": 1, "shutil.copyfile": 1, "shutil.copy2": 1}
    READS = {"torch.load": 0, "numpy.load": 0, "os.path.exists": 0, "os.path.isfile": 0, "os.path.isdir": 0,
             "os.path.getsize": 0, "os.listdir": 0, "torch.jit.load": 0, "pandas.read_csv": 0}

    def _file_ops(self, func: Func, stmts: list[ast.stmt], kind: str) -> list[tuple[str, int, str]]:
        table = self.WRITES if kind == "w" else self.READS
        out = []
        for s in stmts:
            for call in (n for n in ast.walk(s) if isinstance(n, ast.Call)):
                canon = canon_of(func, call.func).replace("np.", "numpy.")
                path = None
                if canon in table:
                    path = argument(call, table[canon], "f")
                elif canon == "open" or dotted(call.func) == "open":
                    mode = argument(call, 1, "mode")
                    m = mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else "r"
                    if (kind == "w") == any(c in m for c in "wax"):
                        path = argument(call, 0, "file")
                elif isinstance(call.func, ast.Attribute):
                    a = call.func.attr
                    if (kind == "w" and a == "save_pretrained") or (kind == "r" and a == "from_pretrained"):
                        path = argument(call, 0)
                if path is not None and self._in_memory(path, func, call.lineno):
                    continue
                k = unparsed(path)
                if k is not None and not isinstance(path, ast.Constant) or (
                        isinstance(path, ast.Constant) and isinstance(path.value, str)):
                    if self.prog.taint(func, path):
                        continue  # a per-rank path (`f"ckpt{rank}.pt"`): each rank has its own file
                    out.append((k, call.lineno, dotted(call.func) or canon))
        return out

    def _in_memory(self, path: ast.AST, func: Func, line: int) -> bool:
        """``torch.save(obj, buffer)`` with an io.BytesIO: no file involved."""
        if isinstance(path, ast.Call):
            return (dotted(path.func) or "").rsplit(".", 1)[-1] in ("BytesIO", "StringIO")
        key = dotted(path)
        value = self.prog.last_assignment(func, key, line + 1) if key else None
        return isinstance(value, ast.Call) and (dotted(value.func) or "").rsplit(".", 1)[-1] in ("BytesIO", "StringIO")

    def missing_barrier(self, func: Func) -> Iterator[Finding]:
        for stmts in blocks_of(func):
            for i, s in enumerate(stmts):
                if not isinstance(s, ast.If):
                    continue
                t = self.prog.test_taint(func, s)
                if not t:
                    continue
                writes = self._file_ops(func, s.body, "w")
                if not writes:
                    continue
                if self.cm.block(s.body, func) or self.cm.block(s.orelse, func):
                    continue  # communication in the branches: the structural rule's business
                paths = {w[0]: w for w in writes}
                readers: list[tuple] = [(r, "in the other branch") for r in self._file_ops(func, s.orelse, "r")]
                for later in stmts[i + 1:]:
                    if self.cm.stmt(later, func) or has_p2p_or_sync(self.cm, later, func):
                        break
                    if isinstance(later, ast.If) and self.prog.test_taint(func, later):
                        continue
                    readers += [(r, "after the branch, on every rank") for r in self._file_ops(func, [later], "r")]
                for (path, rline, rcall), where in readers:
                    w = paths.get(path)
                    if w is None:
                        continue
                    sev = "warning" if is_heuristic(t) else "error"
                    yield make("DD003", sev,
                               f"Ranks where `{ast.unparse(s.test)}` (line {s.lineno}) holds write `{path}` "
                               f"({w[2]}, line {w[1]}) and the file is read ({rcall}, line {rline}) {where} with no "
                               f"collective between: nothing orders the write before the read (a half-written or "
                               f"stale file). The condition depends on the rank through {describe(t)}.",
                               [loc(func.module, rline, "read", func.name), loc(func.module, w[1], "write", func.name),
                                loc(func.module, s.lineno, "condition", func.name)],
                               fix="Put a collective between the write and the reads (dist.barrier() after the "
                                   "rank-guarded save, outside the branch), or broadcast the object instead of "
                                   "passing it through the file system.")
                    break
