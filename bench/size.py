"""The package's size against its budget: physical lines of every .py file outside tests/ and bench/
(the drivers included), per top-level part, and the length of every function (median, max).

    python bench/size.py [--json]

The last stdout line is one JSON object: {"bench": "size", "lines": ..., "budget": ..., ...}.
"""

from __future__ import annotations

import ast
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("core", "model", "actor", "learner", "buffer", "weightsync")
DRIVERS = ("run.py", "jobs.py", "pipeline.py", "sweep.py")
BUDGET = 15_000  # with every feature; the simplification landed at <= 13,000


def package_files(root: str = ROOT) -> list[str]:
    files = [os.path.join(root, d) for d in DRIVERS]
    for part in PARTS:
        for dirpath, _, names in os.walk(os.path.join(root, part)):
            files += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    return sorted(files)


def measure(root: str = ROOT) -> dict:
    per_part, lengths = {}, []
    for path in package_files(root):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        part = os.path.relpath(path, root).split(os.sep)[0]
        per_part[part] = per_part.get(part, 0) + len(text.splitlines())
        lengths += [n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse(text))
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return {"bench": "size", "lines": sum(per_part.values()), "budget": BUDGET, "per_part": per_part,
            "functions": len(lengths), "function_median": statistics.median(lengths), "function_max": max(lengths)}


def main() -> None:
    res = measure()
    if "--json" not in sys.argv:
        for part, n in sorted(res["per_part"].items(), key=lambda kv: -kv[1]):
            print(f"{n:6d}  {part}")
        print(f"{res['lines']:6d}  package (budget {res['budget']:,}); {res['functions']} functions, "
              f"median {res['function_median']} lines, max {res['function_max']}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
