"""Names in a module: dotted spellings of expressions and import aliases resolved to the
canonical module path (``dist.all_reduce`` -> ``torch.distributed.all_reduce``)."""

from __future__ import annotations

import ast


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


class Imports:
    """Alias -> canonical dotted name, from the module's ``import`` statements (any depth: an
    import inside a function counts for the whole module, which is what readers expect)."""

    def __init__(self, tree: ast.AST) -> None:
        self.alias: dict[str, str] = {}
        for node in _statements(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.alias[a.asname] = a.name
                    else:
                        top = a.name.split(".")[0]
                        self.alias.setdefault(top, top)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    if a.name != "*":
                        self.alias[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.ImportFrom) and node.level:
                for a in node.names:  # relative: keep the local module's name, marked
                    if a.name != "*":
                        self.alias[a.asname or a.name] = f".{node.module or ''}.{a.name}"

    def canonical(self, node: ast.AST) -> str | None:
        """The canonical dotted name of a Name/Attribute chain, or None."""
        d = dotted(node)
        if d is None:
            return None
        head, _, rest = d.partition(".")
        base = self.alias.get(head)
        if base is None:
            return d
        return f"{base}.{rest}" if rest else base



def _statements(tree: ast.AST):
    """Every statement of a module, at any depth (expressions are not entered: imports are
    statements, and skipping expressions keeps this cheap)."""
    stack = list(getattr(tree, "body", []))
    while stack:
        node = stack.pop()
        yield node
        for field in ("body", "orelse", "finalbody"):
            sub = getattr(node, field, None)
            if isinstance(sub, list):
                stack.extend(sub)
        for h in getattr(node, "handlers", None) or ():
            stack.extend(h.body)
        for c in getattr(node, "cases", None) or ():
            stack.extend(c.body)


def outer_ifexps(node: ast.AST) -> list[ast.IfExp]:
    """The conditional expressions (``a if c else b``) in ``node``, not nested in another one nor in
    a lambda or definition; ``[node]`` when it is one itself."""
    if isinstance(node, ast.IfExp):
        return [node]
    out: list[ast.IfExp] = []
    todo = [node]
    while todo:
        n = todo.pop()
        for child in ast.iter_child_nodes(n):
            if isinstance(child, ast.IfExp):
                out.append(child)
            elif not isinstance(child, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                todo.append(child)
    return out
