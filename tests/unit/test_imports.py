"""Imports flow one way between the top-level packages (ARCHITECTURE.md, "Layers"), and no two
files of the package or the drivers import each other, directly or around a circle:

    core  <-  model  <-  {actor, learner}        buffer, weightsync  <-  core only

actor and learner may use the buffer's clients and the weight transports, never each other; only
the wiring scripts (run.py, sweep.py, bench/) import across them. Every import statement counts, including
the lazy ones inside functions.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALLOWED = {
    "core": set(),
    "model": {"core"},
    "buffer": {"core"},
    "weightsync": {"core"},
    "actor": {"core", "model", "buffer", "weightsync"},
    "learner": {"core", "model", "buffer", "weightsync"},
}


def _imports(package: str):
    """(file, imported top-level package) for every absolute import in ``package``."""
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    mods = [node.module]
                else:
                    continue
                for m in mods:
                    yield os.path.relpath(path, ROOT), m.split(".")[0]


def test_every_top_level_package_is_listed():
    found = {d for d in os.listdir(ROOT) if os.path.exists(os.path.join(ROOT, d, "__init__.py"))}
    assert found - {"tests", "bench"} == set(ALLOWED)


def test_imports_flow_one_way():
    bad = [f"{path} imports {top}" for pkg, allowed in ALLOWED.items() for path, top in _imports(pkg)
           if top in ALLOWED and top != pkg and top not in allowed]
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_the_rule_has_no_cycle():
    seen, stack = set(), set()

    def visit(p):
        assert p not in stack, f"cycle through {p}"
        if p in seen:
            return
        stack.add(p)
        for q in ALLOWED[p]:
            visit(q)
        stack.discard(p)
        seen.add(p)

    for p in ALLOWED:
        visit(p)


def test_the_walker_sees_lazy_imports():
    """The check would pass vacuously if _imports missed imports inside functions."""
    found = set(_imports("actor"))
    assert ("actor/worker.py", "buffer") in found  # a module-level import
    assert any(path.startswith("actor/tasks/arith.py") and top == "model" for path, top in found)  # lazy


DRIVERS = ("run.py", "jobs.py", "pipeline.py", "sweep.py")


def _file_graph() -> dict[str, set[str]]:
    """Module -> the package/driver modules it imports (lazy and TYPE_CHECKING imports included;
    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module)."""
    paths = [os.path.relpath(os.path.join(d, f), ROOT) for pkg in ALLOWED
             for d, _, fs in os.walk(os.path.join(ROOT, pkg)) for f in fs if f.endswith(".py")]
    mods = {p[:-3].replace("/", ".").removesuffix(".__init__"): p for p in [*paths, *DRIVERS]}

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in mods.items():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        names = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        graph[mod] = {t for t in map(owner, names) if t and t != mod}
    return graph


def _a_circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


def test_no_import_circle_between_files_drivers_included():
    graph = _file_graph()
    assert {"run", "jobs", "pipeline", "sweep", "model.decoder", "learner.losses"} <= set(graph)
    assert "jobs" in graph["pipeline"] and "jobs" in graph["run"]  # the walker sees lazy imports
    circle = _a_circle(graph)
    assert circle is None, " -> ".join(circle)


def test_the_circle_finder_finds_one():
    assert _a_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _a_circle({"a": {"b"}, "b": set()}) is None
