"""Resume inside a generation, on real processes under the local launcher: an actor generating long
sequences (its engine never samples EOS) is frozen just after it saved its batch, the saved file is read, and
it is SIGKILLed. The launcher restarts it; the new incarnation continues every saved sequence from its prefix
-- the same first tokens, behaviour versions kept -- throws none of the saved tokens away, and no group is
trained twice. The run's own end stops the actor mid-batch too: it saves the batch whole, and `run.py
resume` continues it the same way."""

import json
import os
import signal
import threading
import time

import pytest

from actor import partial
from core import config as C
import jobs
from tests.support import patched_actor
from tests.support.runs import TINY_RUN, alive, lines, models_dir, read_json, wait_until


def _freeze_read_kill(run_dir: str, out: dict, env_tokens: bool) -> None:
    """Once actor0 saved a batch with prefixes in it (holding environment tokens if ``env_tokens``: how long
    a prefix is at the first save depends on the engine's speed): SIGSTOP it (the file is then final), read
    the file, SIGKILL."""
    where = partial.path(run_dir, "actor0")

    def saved_with_prefixes():
        try:
            b = partial.load(where, "actor0", 4)
        except OSError:
            return None
        unfinished = [g for g in b.groups if g.seq < 0] if b is not None else []
        if env_tokens and not any(s is not None and s.mask and 0 in s.mask for g in unfinished for s in g.samples):
            return None
        return b if partial.tokens(unfinished) else None

    if not wait_until(saved_with_prefixes, 120, every=0.02):
        return
    pid = read_json(os.path.join(run_dir, "pids.json"))["actor0"]
    os.kill(pid, signal.SIGSTOP)
    out["saved"], out["pid"], out["handed"] = partial.load(where, "actor0", 4), pid, len(lines(out["record"]))
    os.kill(pid, signal.SIGKILL)
    out["killed_at"] = time.monotonic()


# calc: multi-turn episodes (actor/episodes.py), paused at the tool's "]" and continued after its answer: the
# saved prefixes hold environment tokens (mask 0), and one may be waiting for the tool when it is saved
EPISODES = ["task.name=calc", "task.tools.max_turns=1000", "model.pretrain_worked_frac=0.5"]


@pytest.mark.slow
@pytest.mark.parametrize("task", [[], EPISODES], ids=["completions", "episodes"])
def test_a_killed_actor_continues_its_sequences_from_the_saved_prefixes(tmp_path, monkeypatch, task):
    record = str(tmp_path / "handed.jsonl")
    patched_actor.use(monkeypatch, "--long", record)
    cfg = C.load(None, TINY_RUN + task + [
        f"model.cache_dir={models_dir()}", "actor.max_new_tokens=96", "actor.max_batch=2", "actor.partial_save_s=0.2",
        "buffer.max_staleness=4", "run.max_steps=6", "run.max_time_s=240", "run.restart_backoff_s=0.2"])
    seen: dict = {"record": record}

    def on_ready(run_dir, procs):
        threading.Thread(target=_freeze_read_kill, args=(run_dir, seen, bool(task)), daemon=True).start()

    result = jobs.train(cfg, str(tmp_path / "run"), on_ready=on_ready)
    rd = result.run_dir
    assert "saved" in seen, "actor0 never saved a batch with prefixes"
    assert not alive(seen["pid"])
    continued = _check_continued(seen["saved"], record, seen["handed"])
    if task:  # environment tokens were saved mid-episode and continued
        assert any(s is not None and s.mask and 0 in s.mask for g in continued for s in g.samples)
    with open(os.path.join(rd, "logs", "actor0.log")) as f:
        log = f.read()
    assert f"({partial.tokens(continued)} saved tokens); 0 dropped as stale (0 tokens)" in log
    keys = [tuple(k) for rec in lines(os.path.join(rd, "trained_keys.jsonl")) for k in rec["keys"]]
    assert len(keys) == len(set(keys)) and len(keys) == 6 * 4  # every step's groups, none trained twice
    assert json.loads(open(os.path.join(rd, "config.json")).read())["actor"]["partial_save_s"] == 0.2

    # the run's end stops actor0 gracefully, mostly mid-batch (3 runs in 4 here; else between two batches,
    # with nothing to save): it saved that batch whole, and `run.py resume` continues it
    at_end = partial.load(partial.path(rd, "actor0"), "actor0", 4)
    assert (at_end is not None) == ("actor 0 stopped mid-generation" in log[log.rindex("resuming"):])
    handed = len(lines(record))
    result = jobs.train(jobs.load_config(None, rd, ["run.max_steps=8"]), rd)
    assert not result.interrupted
    if at_end is not None and partial.tokens([g for g in at_end.groups if g.seq < 0]):  # (0: stopped before a token)
        _check_continued(at_end, record, handed)
    keys = [tuple(k) for rec in lines(os.path.join(rd, "trained_keys.jsonl")) for k in rec["keys"]]
    assert len(keys) == len(set(keys)) == 8 * 4


def _check_continued(saved, record: str, handed: int) -> list:
    """The next incarnation (after the first ``handed`` records) handed over first the groups ``saved`` left
    unfinished, every sample starting with its saved prefix (tokens, versions, mask) and running on to its limit."""
    continued = {tuple(g.prompt): g for g in saved.groups if g.seq < 0}
    after = lines(record)[handed:][: len(continued)]  # its first batch is the resumed one
    assert sorted(tuple(r["prompt"]) for r in after) == sorted(continued)
    checked = 0
    for r in after:
        g = continued[tuple(r["prompt"])]
        for s, tokens, versions, mask in zip(g.samples, r["tokens"], r["versions"], r["masks"]):
            if s is None:
                continue
            n = len(s.tokens)
            assert tokens[:n] == s.tokens and versions[:n] == s.versions  # continued, not started again
            assert mask[:n] == (s.mask or [1] * n) if mask else s.mask is None
            assert len(tokens) == 96 and min(versions[n:], default=s.versions[-1]) >= s.versions[-1]
            checked += n
    assert checked > 0
    return list(continued.values())
