"""The trained-keys audit and the recovery arithmetic: the cut at the checkpoint, keys never to
be trained again, and versions that never go back."""

import json
import os

from learner import audit as A


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_recovery_cuts_the_audit_and_publishes_above_the_newest_version(tmp_path):
    run_dir = str(tmp_path)
    for step in range(1, 5):
        A.append(run_dir, step, step, [("a", 2 * step), ("a", 2 * step + 1)])
    rec = A.recover(run_dir, ckpt_step=2, ckpt_version=2)  # the learner died after step 4
    assert rec.version == 5 and rec.rolled_back_steps == 2
    assert [r["step"] for r in _lines(tmp_path / A.TRAINED)] == [1, 2]
    assert [r["step"] for r in _lines(tmp_path / A.ROLLED_BACK)] == [3, 4]
    assert rec.retired == {("a", k) for k in range(2, 6)}  # in the checkpoint: never trained again
    again = A.recover(run_dir, ckpt_step=2, ckpt_version=2)  # a crash before anything was published
    assert again.version == 5 and again.rolled_back_steps == 0  # the rolled-back versions still count


def test_clean_resume_keeps_the_checkpoint_version(tmp_path):
    run_dir = str(tmp_path)
    A.append(run_dir, 1, 1, [("a", 0)])
    rec = A.recover(run_dir, ckpt_step=1, ckpt_version=1)
    assert (rec.version, rec.rolled_back_steps, rec.retired) == (1, 0, {("a", 0)})
    os.makedirs(tmp_path / "fresh")
    assert A.recover(str(tmp_path / "fresh"), 0, 0).version == 0  # a new run starts at 0


def test_a_line_torn_by_a_crash_describes_no_step(tmp_path):
    run_dir = str(tmp_path)
    A.append(run_dir, 1, 1, [("a", 0)])
    with open(tmp_path / A.TRAINED, "a") as f:
        f.write('{"step": 2, "version": 2, "ke')
    assert [r["step"] for r in A.read(str(tmp_path / A.TRAINED))] == [1]
    assert A.recover(run_dir, 1, 1).version == 1


def test_retired_keys_are_only_the_recent_steps(tmp_path):
    run_dir = str(tmp_path)
    for step in range(1, A.RECENT_STEPS + 3):
        A.append(run_dir, step, step, [("a", step)])
    rec = A.recover(run_dir, A.RECENT_STEPS + 2, A.RECENT_STEPS + 2)
    assert rec.retired == {("a", s) for s in range(3, A.RECENT_STEPS + 3)}
