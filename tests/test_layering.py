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


def test_no_type_checking_cycle_in_scheduling_or_kvcache() -> None:
    """Inside ``scheduling/`` and ``kvcache/``, not even the imports the type checker alone reads close a
    circle: a type two modules both need lives in the lower one (a per-feature record of ``Request``), or is
    a Protocol (``kvcache.kv_transfer.PoolShape``)."""
    graph = import_graph(type_checking=True)
    assert "kvcache.kv_transfer" in graph["scheduling.batch"]  # an import under ``if TYPE_CHECKING:`` only
    inner = {m: {t for t in targets if t.split(".")[0] in ("scheduling", "kvcache")}
             for m, targets in graph.items() if m.split(".")[0] in ("scheduling", "kvcache")}
    assert len(inner) > 30  # both packages were read
    assert cycles(inner) == []


def test_arrows_between_folders_run_one_way() -> None:
    """Between the folders docs/architecture.md draws (the actors/ jobs among them), no arrow runs both ways."""
    arrows = folder_arrows(import_graph())
    assert ("actors/runner", "actors/models") in arrows  # the folders were read
    assert ("apps/replica", "apps/outputs") in arrows  # apps/ is read by its folders too
    assert sorted((a, b) for a, b in arrows if (b, a) in arrows) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# The replica (apps/) and the fleet policy (cluster/) see the engine through one door: the types in
# actors.api (re-exports included), the engine's settings and errors, the typed control commands, and
# the scheduler handle and its placement. A module named here may reach further, for the reason given.
ENGINE_DOOR = ("actors.api", "actors.config", "actors.errors", "actors.commands", "actors.scheduler")
BEYOND_THE_DOOR = {
    "apps/llm.py": ("actors",),  # the offline engine: it builds and drives an LLMEngine in-process
    # The replica reads its model's folder itself (the tokenizer, before a scheduler exists, which may run
    # elsewhere); actors.api cannot re-export the loader: the root modules sit below actors/load.
    "apps/replica/server.py": ("actors.load.loader",),
}


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(f"{p}.") for p in prefixes)


def engine_imports_past_the_door(relative_path: str, source: str) -> list[str]:
    """The ``actors`` modules ``source`` imports (``TYPE_CHECKING`` ones too) that the door does not allow."""
    allowed = ENGINE_DOOR + BEYOND_THE_DOOR.get(relative_path, ())
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename=relative_path)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from actors import api`` imports the module actors.api
            found += [f"actors.{a.name}" for a in node.names] if node.module == "actors" else [node.module]
    return sorted({m for m in found if m.split(".")[0] == "actors" and not _within(m, allowed)})


def test_apps_and_cluster_reach_the_engine_through_its_door() -> None:
    modules = [m for package in ("apps", "cluster") for m in _modules(package)]
    assert any(m.name == "server.py" for m in modules)  # the replica was read
    past = {str(m.relative_to(ROOT)): engine_imports_past_the_door(str(m.relative_to(ROOT)), m.read_text())
            for m in modules}
    assert {m: bad for m, bad in past.items() if bad} == {}


def test_the_door_check_finds_an_engine_import() -> None:
    source = "from actors.engine.outputs import SequenceDelta\nimport actors.runner.sampler\nfrom actors import api\n"
    assert engine_imports_past_the_door("apps/outputs/x.py", source) == ["actors.engine.outputs",
                                                                          "actors.runner.sampler"]
    assert engine_imports_past_the_door("apps/llm.py", source) == []
    assert engine_imports_past_the_door("apps/x.py", "from actors.api import FinishReason\n"
                                                     "from actors.scheduler.handle import SchedulerHandle\n") == []
