"""The learner journal and recovery arithmetic: torn tails, the audit cut, what is trained again,
and versions that never go back."""

import json
import os

from core import messages as M
from learner import journal as J
from tests.support.tiny import make_group


def _group(seq, versions):
    comps = [([5, 6, 2][:len(versions)], [-1.0] * len(versions), versions, "stop", 1.0) for _ in range(2)]
    return make_group([1, 3], comps, seq=seq)


def _step(run_dir, step, version, groups):
    J.Journal(run_dir).append(step, version, [M.encode(g) for g in groups])
    J.audit(run_dir, step, version, [g.key for g in groups])


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_torn_tail_ends_the_read(tmp_path):
    j = J.Journal(str(tmp_path))
    j.append(1, 1, [b"a"])
    j.append(2, 2, [b"b"])
    with open(j.path, "ab") as f:  # a crash in the middle of the third append
        f.write(J._frame({"step": 3, "version": 3, "groups": [b"c" * 50]})[:-7])
    assert [(f["step"], f["groups"]) for f in j.read()] == [(1, [b"a"]), (2, [b"b"])]
    raw = bytearray(open(j.path, "rb").read())
    raw[J._HEAD.size + 3] ^= 0xFF  # a flipped byte in the first frame: nothing after it is trusted
    open(j.path, "wb").write(bytes(raw))
    assert j.read() == []


def test_recovery_cuts_the_audit_and_trains_the_rest_again(tmp_path):
    run_dir = str(tmp_path)
    J.Journal(run_dir).reset(0)
    g = [_group(i, [0, 0, 0]) for i in range(6)]
    _step(run_dir, 1, 1, g[0:2])
    _step(run_dir, 2, 2, g[2:4])  # the checkpoint is taken here (step 2, version 2) ...
    J.Journal(run_dir).reset(2, keep_after=0)
    late = _group(9, [3, 3, 3])  # sampled by version 3, which the crash takes away
    mixed = _group(10, [2, 3, 3])
    _step(run_dir, 3, 3, g[4:6])
    _step(run_dir, 4, 4, [late, mixed])  # ... and the learner dies after step 4

    rec = J.recover(run_dir, ckpt_step=2, ckpt_version=2, max_staleness=10)
    assert rec.version == 5  # one above the newest ever published
    assert sorted(x.key for x in rec.replay) == sorted(x.key for x in g[4:6] + [mixed])
    assert rec.dropped_rolled_back == 1 and rec.rolled_back_steps == 2
    assert [r["step"] for r in _lines(tmp_path / J.TRAINED)] == [1, 2]
    assert [r["step"] for r in _lines(tmp_path / J.ROLLED_BACK)] == [3, 4]
    assert {x.key for x in g + [late, mixed]} <= rec.retired  # served again by the buffer: never trained

    again = J.recover(run_dir, ckpt_step=2, ckpt_version=2, max_staleness=10)  # a crash right away
    assert again.version == 6 and [x.key for x in again.replay] == [x.key for x in rec.replay]
    assert [r["step"] for r in _lines(tmp_path / J.ROLLED_BACK)] == [3, 4]


def test_stale_groups_are_not_trained_again(tmp_path):
    run_dir = str(tmp_path)
    _step(run_dir, 1, 1, [_group(0, [0, 0, 0])])
    rec = J.recover(run_dir, ckpt_step=0, ckpt_version=0, max_staleness=1)
    assert rec.version == 2 and rec.replay == [] and rec.dropped_stale == 1


def test_clean_resume_keeps_the_checkpoint_version(tmp_path):
    run_dir = str(tmp_path)
    _step(run_dir, 1, 1, [_group(0, [0, 0, 0])])
    J.Journal(run_dir).reset(1, keep_after=0)  # the final checkpoint at step 1
    rec = J.recover(run_dir, ckpt_step=1, ckpt_version=1, max_staleness=4)
    assert (rec.version, rec.replay, rec.rolled_back_steps) == (1, [], 0)
    os.makedirs(tmp_path / "fresh")
    assert J.recover(str(tmp_path / "fresh"), 0, 0, 4).version == 0  # a new run starts at 0


def test_a_damaged_newest_checkpoint_still_finds_its_groups(tmp_path):
    """The journal keeps the frames since the checkpoint before the newest: if the newest is
    damaged and the older one is loaded, the groups trained in between are trained again."""
    run_dir = str(tmp_path)
    a, b = _group(0, [1, 1, 1]), _group(1, [2, 2, 2])
    _step(run_dir, 1, 1, [_group(5, [0, 0, 0])])
    J.Journal(run_dir).reset(1, keep_after=0)  # checkpoint 1
    _step(run_dir, 2, 2, [a])
    _step(run_dir, 3, 3, [b])
    J.Journal(run_dir).reset(3, keep_after=1)  # checkpoint 3, found damaged later
    rec = J.recover(run_dir, ckpt_step=1, ckpt_version=1, max_staleness=10)
    assert [g.key for g in rec.replay] == [a.key] and rec.dropped_rolled_back == 1  # b: version 2 > 1
    assert rec.version == 4
