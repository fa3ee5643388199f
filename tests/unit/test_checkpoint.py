"""Checkpoints: exact round trip, atomicity under a crash, retention, HF loadability, no pickle."""

import os
import random

import pytest
import torch

from core.files import atomic_dir
from learner import checkpoint as ck
from learner.backends.torch import TorchBackend
from learner.batching import collate
from tests.support.tiny import make_group, tiny_cfg, tiny_model, tiny_model_dir, tiny_task


def Trainer(cfg, model):
    return TorchBackend(cfg, tiny_model_dir(), model=model)

torch.set_num_threads(1)


def _batch():
    prompt = [1, 7, 11, 8, 15, 18]
    comps = [([9 + k, 4 + k, 2], [-2.0, -2.1, -2.2], [0, 0, 0], "stop", float(k == 0)) for k in range(4)]
    return collate([make_group(prompt, comps)], learner_version=0)


def _trained(steps=2):
    trainer = Trainer(tiny_cfg("learner.body_dtype=float32"), tiny_model())
    for _ in range(steps):
        trainer.step(_batch())
    return trainer


def _fresh():
    return Trainer(tiny_cfg("learner.body_dtype=float32"), tiny_model())


def test_round_trip_is_exact(tmp_path):
    src = _trained()
    root = str(tmp_path / "checkpoints")
    random.seed(123)
    torch.manual_seed(321)
    path = ck.save(root, 2, src, {"version": 2, "consumed_groups": 16})
    next_torch, next_py = torch.rand(4), random.random()  # what the run would draw next
    torch.rand(100), random.random()  # ...then the "crash" moves both generators on

    dst = _fresh()
    meta = ck.load(path, dst)
    assert torch.equal(torch.rand(4), next_torch) and random.random() == next_py
    assert (meta["step"], meta["version"], meta["consumed_groups"]) == (2, 2, 16)

    a, b = src.model.state_dict(), dst.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = src.opt.state_dict(), dst.opt.state_dict()
    assert sa["state"].keys() == sb["state"].keys() and len(sa["state"]) > 0
    for idx in sa["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sa["state"][idx][name]), torch.as_tensor(sb["state"][idx][name]))
    for ga, gb in zip(sa["param_groups"], sb["param_groups"]):
        assert ga["lr"] == gb["lr"] and tuple(ga["betas"]) == tuple(gb["betas"]) and ga["params"] == gb["params"]

    # the restored trainer continues exactly as the original would have
    src.step(_batch())
    dst.step(_batch())
    a, b = src.model.state_dict(), dst.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_incomplete_directory_is_never_latest(tmp_path):
    root = str(tmp_path / "checkpoints")
    trainer = _trained(1)
    good = ck.save(root, 1, trainer, {"version": 1})
    partial = os.path.join(root, "step_000009")  # a newer step that died before COMPLETE
    os.makedirs(os.path.join(partial, "model"))
    with open(os.path.join(partial, "meta.json"), "w") as f:
        f.write('{"step": 9')
    assert ck.latest(root) == good
    assert ck.complete_checkpoints(root) == [good]
    with pytest.raises(FileNotFoundError, match="COMPLETE"):
        ck.load(partial, trainer)
    assert ck.latest(str(tmp_path / "nothing-here")) is None


def test_crash_inside_write_leaves_nothing_behind(tmp_path):
    final = tmp_path / "checkpoints" / "step_000003"

    def dies_half_way(tmp):
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            f.write("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_dir(str(final), dies_half_way, marker=ck.MARKER)
    assert not final.exists()
    assert os.listdir(final.parent) == []  # no .tmp-* left over
    assert ck.latest(str(final.parent)) is None


def test_crash_while_rewriting_keeps_the_previous_copy(tmp_path):
    final = tmp_path / "export"
    atomic_dir(str(final), lambda tmp: open(os.path.join(tmp, "a.json"), "w").write("1"), marker=ck.MARKER)

    def dies(tmp):
        open(os.path.join(tmp, "a.json"), "w").write("2")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_dir(str(final), dies, marker=ck.MARKER)
    assert (final / "a.json").read_text() == "1" and (final / ck.MARKER).exists()
    assert sorted(os.listdir(tmp_path)) == ["export"]


def test_only_newest_are_kept(tmp_path):
    root = str(tmp_path / "checkpoints")
    trainer = _trained(1)
    paths = [ck.save(root, s, trainer, {"version": s}) for s in (1, 2, 3, 10)]
    assert ck.complete_checkpoints(root) == paths[-ck.KEEP:]
    assert sorted(os.listdir(root)) == sorted(os.path.basename(p) for p in paths[-ck.KEEP:])
    assert ck.latest(root) == paths[-1]


def test_model_dir_loads_in_transformers_with_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    trainer = _trained(2)
    path = ck.save(str(tmp_path), 2, trainer, {"version": 2})
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(path, "model"),
                                                           dtype=torch.float32).eval()
    ids = _batch().ids
    n = ids.shape[1]
    with torch.no_grad():
        ours = trainer.model.logits(trainer.model(ids, torch.arange(n).expand_as(ids), torch.ones_like(ids).bool()))
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(path, "model"))
    assert tok("<s>47+38=", add_special_tokens=False)["input_ids"] == [tiny_task().tok.bos_id, *tiny_task().tok.encode("47+38=")]


def test_save_model_exports_an_hf_dir(tmp_path):
    model = tiny_model()
    out = ck.save_model(Trainer(tiny_cfg(), model), str(tmp_path / "final"))
    assert sorted(os.listdir(out)) == sorted(
        ["COMPLETE", "MANIFEST.json", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"])
    from model.hf import load_pretrained
    back = load_pretrained(out)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())


def test_nothing_is_pickled(tmp_path):
    trainer = _trained(1)
    path = ck.save(str(tmp_path), 1, trainer, {"version": 1})
    files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    assert len(files) >= 7
    for f in files:
        name = os.path.basename(f)
        assert name == ck.MARKER or name.endswith((".json", ".safetensors")), name
        with open(f, "rb") as fh:
            head = fh.read(2)
        assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), f"{f} is a pickle"
        assert head != b"PK", f"{f} is a zip (torch.save) archive"


def _two_checkpoints(tmp_path):
    root = str(tmp_path / "checkpoints")
    trainer = _trained(1)
    older = ck.save(root, 1, trainer, {"version": 1})
    trainer.step(_batch())
    newer = ck.save(root, 2, trainer, {"version": 2})
    return root, older, newer


def test_corrupted_newest_is_skipped_for_the_older(tmp_path, caplog):
    root, older, newer = _two_checkpoints(tmp_path)
    weights = os.path.join(newer, "model", "model.safetensors")
    with open(weights, "r+b") as f:  # 256 floats changed in place: same size, same header
        f.seek(os.path.getsize(weights) - 1024)
        f.write(torch.full((256,), 0.5).numpy().tobytes())
    assert ck.latest(root) == older
    assert "damaged checkpoint" in caplog.text and "sha256" in caplog.text
    with pytest.raises(ck.DamagedCheckpoint, match="model.safetensors"):
        ck.load(newer, _fresh())
    meta = ck.load(ck.latest(root), _fresh())
    assert meta["step"] == 1


def test_truncated_newest_is_skipped_for_the_older(tmp_path, caplog):
    root, older, newer = _two_checkpoints(tmp_path)
    optim = os.path.join(newer, "optim.safetensors")
    os.truncate(optim, os.path.getsize(optim) // 2)
    assert ck.latest(root) == older
    assert "truncated" in caplog.text
    os.unlink(os.path.join(older, ck.MANIFEST))  # no manifest: unverifiable, never loaded
    assert ck.latest(root) is None


def test_a_failed_write_names_the_path_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    trainer = _trained(1)
    root = str(tmp_path / "checkpoints")
    good = ck.save(root, 1, trainer, {"version": 1})

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "save_state", full)
    with pytest.raises(ck.WriteError, match=r"cannot write the checkpoint .*step_000002: No space left"):
        ck.save(root, 2, trainer, {"version": 2})
    monkeypatch.setattr(trainer, "save_model", full)
    with pytest.raises(ck.WriteError, match=r"the final model .*final_model"):
        ck.save_model(trainer, str(tmp_path / "final_model"))
    assert os.listdir(root) == [os.path.basename(good)]  # no torn or temporary directory
    assert not (tmp_path / "final_model").exists() and ck.latest(root) == good


def _flip(path: str) -> None:
    with open(path, "r+b") as f:  # same size, same header: only the sha256 can tell
        f.seek(os.path.getsize(path) - 1024)
        f.write(torch.full((256,), 0.5).numpy().tobytes())


def test_a_final_model_carries_its_manifest_and_flipped_weights_are_named(tmp_path):
    final = ck.save_model(_trained(1), str(tmp_path / "final_model"))
    ck.verify_model(final)  # intact
    _flip(os.path.join(final, "model.safetensors"))
    with pytest.raises(ck.DamagedCheckpoint, match="model.safetensors"):
        ck.verify_model(final)
    root, _, newer = _two_checkpoints(tmp_path)
    _flip(os.path.join(newer, "model", "model.safetensors"))
    with pytest.raises(ck.DamagedCheckpoint, match="sha256"):  # a checkpoint's model/: its parent's manifest
        ck.verify_model(os.path.join(newer, "model"))
    ck.verify_model(tiny_model_dir())  # a model directory that is not a run's: not ours to check


def test_a_learner_whose_every_checkpoint_is_damaged_refuses_to_start_over(tmp_path):
    from learner.loop import LearnerLoop
    from tests.unit.test_learner_loop import FakeClient, FakeSink, _loop

    loop = _loop(tmp_path)
    loop.save()
    loop.close()
    [path] = ck.complete_checkpoints(loop.ckpt_root)
    _flip(os.path.join(path, "model", "model.safetensors"))
    with pytest.raises(ck.DamagedCheckpoint, match="every checkpoint"):
        LearnerLoop(loop.cfg, str(tmp_path), client=FakeClient(), metrics=FakeSink())


def test_eval_of_a_run_whose_final_model_is_damaged_says_so_in_one_line(tmp_path):
    import subprocess
    import sys

    from tests.support.runs import ROOT

    final = ck.save_model(_trained(1), str(tmp_path / "run" / "final_model"))
    _flip(os.path.join(final, "model.safetensors"))
    out = subprocess.run([sys.executable, "run.py", "eval", str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 65 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "damaged" in out.stderr and "model.safetensors" in out.stderr
