"""The units the source analysis walks: a parsed file (:class:`Module`) and a function, a
method or a module's top-level code (:class:`Func`), with what the last walk recorded about it
(:class:`Facts`). No analysis here: ``flow`` and ``program`` fill these in."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field

from .names import Imports, dotted
from .taint import CLEAN


@dataclass
class Facts:
    """What the last walk of a function recorded: taint of reads and of conditions."""

    loads: dict[int, frozenset] = field(default_factory=dict)
    tests: dict[int, frozenset] = field(default_factory=dict)


class Module:
    def __init__(self, path: str, source: str, display: str | None = None) -> None:
        self.path = path
        self.display = display or path
        self.source = source
        self.lines = source.splitlines()
        self.tree = ast.parse(source, filename=path)
        self.imports = Imports(self.tree)
        self.name = os.path.splitext(os.path.basename(path))[0]

    def line(self, n: int) -> str:
        return self.lines[n - 1].strip() if 0 < n <= len(self.lines) else ""


class Func:
    """A function, a method, or a module's top-level code (``node`` is the Module)."""

    def __init__(self, module: Module, node, cls: ast.ClassDef | None, parent: Func | None, qual: str) -> None:
        self.module = module
        self.node = node
        self.cls = cls
        self.parent = parent
        self.qual = qual
        self.name = getattr(node, "name", "<module>")
        if isinstance(node, ast.Module):
            self.params: list[str] = []
            self.body = [s for s in node.body]
        else:
            a = node.args
            self.params = [p.arg for p in getattr(a, "posonlyargs", [])] + [p.arg for p in a.args] + \
                [p.arg for p in a.kwonlyargs]
            self.body = node.body
        self.facts = Facts()
        self.returns: frozenset = CLEAN
        self.param_taint: list[frozenset] = [CLEAN] * len(self.params)
        self.final_env: dict[str, frozenset] = {}
        self.calls: list = []  # (callee, [arg taint]) noted in the last walk
        self.is_method = cls is not None and not isinstance(node, ast.Module)
        self.is_static = any(dotted(d) == "staticmethod" for d in getattr(node, "decorator_list", []))

    @property
    def scope(self) -> list:
        """Every node of the function, not into nested functions/classes (cached: the rules
        read it many times)."""
        got = self.__dict__.get("_scope")
        if got is None:
            got = self.__dict__["_scope"] = list(walk_scope(self.node))
        return got

    @property
    def call_nodes(self) -> list:
        """The function's calls in source order (cached)."""
        got = self.__dict__.get("_calls")
        if got is None:
            got = [n for n in self.scope if isinstance(n, ast.Call)]
            got.sort(key=lambda c: (c.lineno, c.col_offset))
            self.__dict__["_calls"] = got
        return got

    @property
    def call_starts(self) -> list:
        got = self.__dict__.get("_starts")
        if got is None:
            got = self.__dict__["_starts"] = [(c.lineno, c.col_offset) for c in self.call_nodes]
        return got

    @property
    def is_module(self) -> bool:
        return isinstance(self.node, ast.Module)

    def __repr__(self) -> str:
        return f"<Func {self.qual}>"


def walk_scope(node):
    """ast.walk without descending into nested functions and classes (module: top level only)."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        n = stack.pop()
        yield n
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(ast.iter_child_nodes(n))
