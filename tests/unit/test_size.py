"""The package stays within its size budget (bench/size.py) and counts every file of it."""

import os

from bench import size

SKIP = {"tests", "bench", "runs", "build", "dist"}


def test_every_package_file_is_counted():
    tops = {d for d in os.listdir(size.ROOT) if os.path.isdir(os.path.join(size.ROOT, d))
            and not d.startswith(".") and d not in SKIP and not d.endswith(".egg-info")
            and any(f.endswith(".py") for _, _, fs in os.walk(os.path.join(size.ROOT, d)) for f in fs)}
    assert tops == set(size.PARTS)
    assert {f for f in os.listdir(size.ROOT) if f.endswith(".py")} == set(size.DRIVERS)


def test_the_package_is_within_its_budget_and_functions_stay_short():
    res = size.measure()
    assert 0 < res["lines"] <= res["budget"], res["per_part"]
    assert res["function_max"] <= 74 and res["function_median"] <= 10
