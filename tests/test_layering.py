"""The import arrows run one way: scripts -> cli -> apps -> cluster -> actors -> scheduling -> kvcache.

Every import in every module (function-level ones included) is read with
``ast``; a module may import its own package and those below it, never one
above. The client SDK (``flotilla``) imports none of them; the tools above
the server (``cli``, ``scripts``) may use it, as any client does.

Inside the layers, no module imports itself back round a circle at run
time: imports under ``if TYPE_CHECKING:`` are the one exception, since they
never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAIN = ["scripts", "cli", "apps", "cluster", "actors", "scheduling", "kvcache"]
PACKAGES = [*CHAIN, "flotilla"]


def _imported_packages(path: Path) -> set[str]:
    """The repo packages ``path`` imports (first dotted component), relative imports left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & set(PACKAGES)


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_only_run_down_the_chain(package: str) -> None:
    allowed = {package} if package == "flotilla" else set(CHAIN[CHAIN.index(package):])
    if package in ("scripts", "cli"):
        allowed.add("flotilla")  # the tools are clients too: the benchmarks read streams with the SDK's parser
    modules = _modules(package)
    assert modules, f"no modules under {package}/"
    upward = {str(m.relative_to(ROOT)): sorted(_imported_packages(m) - allowed) for m in modules}
    assert {m: bad for m, bad in upward.items() if bad} == {}


def test_cluster_holds_no_tools_above_apps() -> None:
    assert not list((ROOT / "cluster").glob("bench_*.py"))
    assert not list((ROOT / "cluster").glob("*cli*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import that runs (module, class or function level), those under ``if TYPE_CHECKING:`` left out."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)  # only its else branch runs
            else:
                stack.append(child)
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module -> the repo modules it imports at run time (``from pkg import mod`` counts as ``pkg.mod``)."""
    modules = {_module_name(p): p for package in PACKAGES for p in _modules(package)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in modules)
            elif node.module and node.level == 0 and node.module.split(".")[0] in PACKAGES:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = (targets & modules.keys()) - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def test_no_import_cycle_between_modules() -> None:
    """No two modules import each other at run time, directly or round a circle (``TYPE_CHECKING`` aside)."""
    graph = _import_graph()
    assert len(graph) > 100  # the whole house was read
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
