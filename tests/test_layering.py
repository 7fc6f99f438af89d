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

from tests.import_graph import cycles, folder_arrows, import_graph

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


def test_no_import_cycle_between_modules() -> None:
    """No two modules import each other at run time, directly or round a circle (``TYPE_CHECKING`` aside)."""
    graph = import_graph()
    assert len(graph) > 100  # the whole house was read
    assert cycles(graph) == []


def test_arrows_between_folders_run_one_way() -> None:
    """Between the folders docs/architecture.md draws (the actors/ jobs among them), no arrow runs both ways."""
    arrows = folder_arrows(import_graph())
    assert ("actors/runner", "actors/models") in arrows  # the folders were read
    assert sorted((a, b) for a, b in arrows if (b, a) in arrows) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
