"""The repo's import graph, read with ``ast``: what tests/test_layering.py checks and docs/architecture.md draws.

    .venv/bin/python -m tests.import_graph

prints the diagram of folders and their import arrows (mermaid) that
docs/architecture.md shows: one node per top-level package, and one per job
inside ``actors/`` and ``apps/`` (a request's way: protocol, inputs, tools, outputs, responses,
replica) and ``kvcache/attention``; an arrow where some module of
one imports a module of the other at run time (imports under ``if
TYPE_CHECKING:`` never run and are left out), less arrows that a path of
others already implies.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHAIN = ["scripts", "cli", "apps", "cluster", "actors", "scheduling", "kvcache"]
PACKAGES = [*CHAIN, "flotilla"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(tree: ast.AST, *, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import that runs (module, class or function level), those under ``if TYPE_CHECKING:`` left out
    unless ``type_checking`` (then every import the type checker reads too)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            if not type_checking and isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)  # only its else branch runs
            else:
                stack.append(child)
    return found


def import_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the repo modules it imports at run time (``from pkg import mod`` counts as ``pkg.mod``);
    with ``type_checking``, those it imports under ``if TYPE_CHECKING:`` as well."""
    modules = {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in runtime_imports(ast.parse(path.read_text(), filename=str(path)), type_checking=type_checking):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in modules)
            elif node.module and node.level == 0 and node.module.split(".")[0] in PACKAGES:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = (targets & modules.keys()) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def folder(module: str) -> str:
    """The folder the diagram gives ``module``: its top-level package, or its job inside ``actors/`` or ``apps/``."""
    parts = module.split(".")
    if parts[0] in ("actors", "apps") and len(parts) > 1 and (ROOT / parts[0] / parts[1]).is_dir():
        return f"{parts[0]}/{parts[1]}"
    if parts[:2] == ["kvcache", "attention"]:
        return "kvcache/attention"
    return parts[0]


def folder_arrows(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer folder, imported folder) for every run-time import between two folders."""
    return {(folder(a), folder(b)) for a, targets in graph.items() for b in targets if folder(a) != folder(b)}


def reduced(arrows: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The arrows no longer path implies (a transitive reduction; the arrows must form no cycle)."""
    succ: dict[str, set[str]] = {}
    for a, b in arrows:
        succ.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str, skip: tuple[str, str]) -> bool:
        seen, todo = {start}, [start]
        while todo:
            node = todo.pop()
            for nxt in succ.get(node, ()):
                if (node, nxt) == skip or nxt in seen:
                    continue
                if nxt == goal:
                    return True
                seen.add(nxt)
                todo.append(nxt)
        return False

    return {(a, b) for a, b in arrows if not reaches(a, b, (a, b))}


def mermaid(arrows: set[tuple[str, str]]) -> str:
    def node(name: str) -> str:
        # the root modules every actors/ job shares; apps/'s root holds the builder and the offline LLM
        label = {"actors": "actors/*.py", "apps": "apps/*.py"}.get(name, f"{name}/")
        return f'{name.replace("/", "_")}["{label}"]'

    lines = ["flowchart TD"] + [f"  {node(a)} --> {node(b)}" for a, b in sorted(arrows)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(mermaid(reduced(folder_arrows(import_graph()))))
