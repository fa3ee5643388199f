"""Imports flow one way between the top-level packages (ARCHITECTURE.md, "Layers"):

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
