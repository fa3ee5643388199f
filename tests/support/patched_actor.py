"""An actor role with a test-only fault patched in, for the tests of whole runs (real launcher,
processes and sockets): :func:`use` makes the launcher start every actor as
``python -m tests.support.patched_actor [--skew LO:HI:FACTOR] [--scorer module:function] -- ARGS``,
which patches ``actor.worker`` in that process and runs its ``main(ARGS)``.

``--skew``: batches started at a policy version in ``LO..HI`` are sampled at ``FACTOR`` x the
configured temperature while the learner's numerator keeps the configured one -- a silent
engine/learner mismatch (tests/integration/test_control.py); each skewed group is logged.
``--scorer``: every reward pool checks its answers with this scorer instead of its task's
(tests/integration/test_external_tasks.py plants a hanging checker so).
``--long PATH``: the engine never samples EOS (every sequence runs to its limit: long generations from a tiny
model) and each group handed over is appended to the JSON lines file PATH with this process's pid
(tests/integration/test_partial_resume.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

log = logging.getLogger("driftrl.actor")


def use(monkeypatch, *flags: str) -> None:
    """Make ``core.launchers`` start every actor through this module with ``flags``."""
    from core import launchers

    roles = launchers.roles

    def patched(*args, **kwargs):
        out = roles(*args, **kwargs)
        for role in out:
            if role.name.startswith("actor"):
                assert role.argv[1:3] == ["-m", "actor.worker"], role.argv
                role.argv[1:3] = ["-m", __name__, *flags, "--"]
        return out

    monkeypatch.setattr(launchers, "roles", patched)


def skew(spec: str) -> None:
    from actor.worker import RolloutWorker

    lo, hi, factor = spec.split(":")
    generate = RolloutWorker.generate_groups

    def skewed(self, batch):
        configured = self.__dict__.setdefault("configured_spec", self.engine.spec)
        on = int(lo) <= self.engine.version <= int(hi)
        temperature = configured.temperature * (float(factor) if on else 1.0)
        self.engine.spec = dataclasses.replace(configured, temperature=temperature)
        for group in generate(self, batch):
            if on:
                log.warning("group %s sampled at temperature x%s (test hook)", list(group.key), factor)
            yield group

    RolloutWorker.generate_groups = skewed


def scorer(spec: str) -> None:
    from actor.rewards import RewardPool

    init = RewardPool.__init__

    def with_scorer(self, _scorer, *args, **kwargs):
        init(self, spec, *args, **kwargs)

    RewardPool.__init__ = with_scorer


def long(path: str) -> None:
    import json
    import os

    import numpy as np
    import torch

    from actor.worker import RolloutWorker

    init, hand_over = RolloutWorker.__init__, RolloutWorker._hand_over

    def no_eos(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.engine.eos_ids = torch.tensor([-1], device=self.engine.eos_ids.device)

    def recorded(self, group):
        ints = lambda b: np.frombuffer(b, dtype=np.int32).tolist()  # noqa: E731
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "seq": group.seq, "prompt": ints(group.prompt_tokens),
                                "tokens": [ints(c.tokens) for c in group.completions],
                                "versions": [ints(c.versions) for c in group.completions],
                                "masks": [list(c.mask) for c in group.completions]}) + "\n")
        hand_over(self, group)

    RolloutWorker.__init__, RolloutWorker._hand_over = no_eos, recorded


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skew")
    ap.add_argument("--scorer")
    ap.add_argument("--long")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.skew:
        skew(args.skew)
    if args.scorer:
        scorer(args.scorer)
    if args.long:
        long(args.long)
    from actor import worker

    worker.main([a for a in args.rest if a != "--"])


if __name__ == "__main__":
    main(sys.argv[1:])
