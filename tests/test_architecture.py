"""The house's shape, as docs/design.md draws it: no import circle anywhere in the package code, no room
importing one above it (orchestrator/ on top, trainer/ and rollout/ in the middle, ckpt_transfer/ and sandbox/
at the bottom, neither importing the other), orchestrator's sub-packages importing only those below them, and no
package file over 500 lines. Read from the source (every import, those inside functions included), nothing is
imported."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = {"orchestrator": 2, "trainer": 1, "rollout": 1, "ckpt_transfer": 0, "sandbox": 0}
# bottom to top: each imports only those before it (orchestrator/__init__.py)
ORCHESTRATOR = ["records", "rewards", "config", "workers", "agents", "iteration", "run"]
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            if "harness" in path.parts:  # run inside the sandbox's containers, never imported by the host
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base) for a in node.names}
        graph[name] = deps - {None, name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _rooms_upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a room above the importer's, or beside it at the bottom."""
    wrong = []
    for name, deps in graph.items():
        room = name.split(".")[0]
        for dep in deps:
            other = dep.split(".")[0]
            if ROOMS[other] > ROOMS[room] or (other != room and ROOMS[other] == ROOMS[room] == 0):
                wrong.append(f"{name} -> {dep}")
    return wrong


def _orchestrator_upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports of an orchestrator sub-package above the importer's (ORCHESTRATOR, bottom to top)."""
    def floor(module: str) -> int:
        sub = module.split(".")[1]
        assert sub in ORCHESTRATOR, f"{module}: orchestrator's modules live in one of its sub-packages {ORCHESTRATOR}"
        return ORCHESTRATOR.index(sub)

    return [f"{name} -> {dep}" for name, deps in graph.items() if name.startswith("orchestrator.")
            for dep in deps if dep.startswith("orchestrator.") and floor(dep) > floor(name)]


GRAPH = _graph(_modules())


def test_no_import_circle():
    assert _cycles(GRAPH) == []


def test_no_room_imports_one_above_it_or_beside_it_at_the_bottom():
    assert _rooms_upward(GRAPH) == []


def test_orchestrator_sub_packages_import_only_those_below_them():
    assert _orchestrator_upward(GRAPH) == []


def test_no_package_file_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_checks_see_a_circle_and_an_arrow_up():
    """The checks above find what they look for (a test that cannot fail checks nothing), on small graphs and on
    the edges the real graph must hold."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _rooms_upward({"sandbox.x": {"ckpt_transfer.y"}, "rollout.engine": {"orchestrator.run.cli"},
                          "orchestrator.run.cli": {"rollout.engine"}}) == ["sandbox.x -> ckpt_transfer.y",
                                                                           "rollout.engine -> orchestrator.run.cli"]
    assert _orchestrator_upward({"orchestrator.config.schema": {"orchestrator.iteration.loop",
                                                                "orchestrator.records.rundir"}}) == [
        "orchestrator.config.schema -> orchestrator.iteration.loop"]
    assert "trainer.config" in GRAPH["orchestrator.config.schema"]
    assert "orchestrator.iteration.schedule" in GRAPH["orchestrator.iteration.loop"]
