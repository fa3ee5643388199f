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


def _freeze_read_kill(run_dir: str, out: dict) -> None:
    """Once actor0 saved a batch with prefixes in it: SIGSTOP it (the file is then final), read the file, SIGKILL."""
    where = partial.path(run_dir, "actor0")

    def saved_with_prefixes():
        try:
            b = partial.load(where, "actor0", 4)
        except OSError:
            return None
        return b if b is not None and partial.tokens([g for g in b.groups if g.seq < 0]) else None

    if not wait_until(saved_with_prefixes, 120, every=0.02):
        return
    pid = read_json(os.path.join(run_dir, "pids.json"))["actor0"]
    os.kill(pid, signal.SIGSTOP)
    out["saved"], out["pid"] = partial.load(where, "actor0", 4), pid
    os.kill(pid, signal.SIGKILL)
    out["killed_at"] = time.monotonic()


@pytest.mark.slow
def test_a_killed_actor_continues_its_sequences_from_the_saved_prefixes(tmp_path, monkeypatch):
    record = str(tmp_path / "handed.jsonl")
    patched_actor.use(monkeypatch, "--long", record)
    cfg = C.load(None, TINY_RUN + [f"model.cache_dir={models_dir()}", "actor.max_new_tokens=96", "actor.max_batch=2",
                                   "actor.partial_save_s=0.2", "buffer.max_staleness=4", "run.max_steps=6",
                                   "run.max_time_s=240", "run.restart_backoff_s=0.2"])
    seen: dict = {}

    def on_ready(run_dir, procs):
        threading.Thread(target=_freeze_read_kill, args=(run_dir, seen), daemon=True).start()

    result = jobs.train(cfg, str(tmp_path / "run"), on_ready=on_ready)
    rd = result.run_dir
    assert "saved" in seen, "actor0 never saved a batch with prefixes"
    assert not alive(seen["pid"])
    continued = _check_continued(seen["saved"], record, seen["pid"])
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
    last = list(dict.fromkeys(r["pid"] for r in lines(record)))[-1]
    result = jobs.train(jobs.load_config(None, rd, ["run.max_steps=8"]), rd)
    assert not result.interrupted
    if at_end is not None:
        assert partial.tokens([g for g in at_end.groups if g.seq < 0]) > 0
        _check_continued(at_end, record, last)
    keys = [tuple(k) for rec in lines(os.path.join(rd, "trained_keys.jsonl")) for k in rec["keys"]]
    assert len(keys) == len(set(keys)) == 8 * 4


def _check_continued(saved, record: str, pid: int) -> list:
    """The incarnation after ``pid`` handed over first the groups ``saved`` left unfinished, every sample
    starting with its saved prefix (tokens and versions) and running on to its limit."""
    continued = {tuple(g.prompt): g for g in saved.groups if g.seq < 0}
    pids = list(dict.fromkeys(r["pid"] for r in lines(record)))
    new = pids[pids.index(pid) + 1]  # the next incarnation: its first batch is the resumed one
    after = [r for r in lines(record) if r["pid"] == new][: len(continued)]
    assert sorted(tuple(r["prompt"]) for r in after) == sorted(continued)
    checked = 0
    for r in after:
        g = continued[tuple(r["prompt"])]
        for s, tokens, versions in zip(g.samples, r["tokens"], r["versions"]):
            if s is None:
                continue
            n = len(s.tokens)
            assert tokens[:n] == s.tokens and versions[:n] == s.versions  # continued, not started again
            assert len(tokens) == 96 and min(versions[n:], default=s.versions[-1]) >= s.versions[-1]
            checked += n
    assert checked > 0
    return list(continued.values())
