"""No import cycle among the modules of ``dsfuse`` (module-level imports, read with ``ast``).

An import inside a function runs when it is called, after every module has loaded, so only the
imports a module runs when it is loaded count. ``from a.b import c`` depends on module ``a.b.c``
when that is a module, else on ``a.b``; the parent packages Python runs on the way are not counted
(every package's ``__init__`` imports its own modules)."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kernels" / "dsfuse"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("dsfuse",) + path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _module_level(body):
    """Import statements run at load: the module's, in ``if``/``try``/``with`` blocks too."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, []):
                    yield from _module_level(child.body if isinstance(child, ast.ExceptHandler) else [child])


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in _module_level(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        edges[name] = deps
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(edges[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle():
    cycles = _cycles(_edges(_modules()))
    assert not cycles, "import cycles (module-level imports):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_a_cycle_is_found():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_gdn_api_and_cp_local_do_not_import_each_other():
    edges = _edges(_modules())
    assert "dsfuse.gdn.api" not in edges["dsfuse.gdn.cp_local"]


def test_no_rest_roles_in_docstrings():
    """The site renders docstrings as Markdown: a reST role (`:func:` ...) would show as raw text."""
    role = re.compile(r":(?:func|class|mod|meth|attr|data|obj|ref):`")
    found = [f"{p.relative_to(PACKAGE)}:{i}" for p in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if role.search(line)]
    assert found == [], "reST roles (use backticks or [name][dsfuse.module.name]): " + ", ".join(found)
