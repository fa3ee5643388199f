"""Config validation covers meaning, not only types: finite floats everywhere, ranges, model sizes,
a writable run_dir, a readable TOML file; ``run.py`` reports a bad value in one line, exit 2."""

import json
import os
import subprocess
import sys

import pytest

import jobs
from core import config as C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HOSTILE = [  # (override, the field path its error names)
    ("learner.lr=inf", "$.learner.lr"),
    ("learner.lr=nan", "$.learner.lr"),
    ("learner.lr=-inf", "$.learner.lr"),
    ("learner.betas=[nan, 0.99]", "$.learner.betas"),
    ("learner.betas=[1.5, 0.99]", "$.learner.betas"),
    ("learner.betas=[0.9, 1.0]", "$.learner.betas"),
    ("learner.betas=[-0.1, 0.99]", "$.learner.betas"),
    ("learner.betas=[0.9, inf]", "$.learner.betas"),
    ("actor.temperature=inf", "$.actor.temperature"),
    ("actor.temperature=0", "$.actor.temperature"),
    ("learner.eps_high=inf", "$.learner.eps_high"),
    ("learner.eps_clip=1.5", "$.learner.eps_clip"),
    ("learner.kl_beta=inf", "$.learner.kl_beta"),
    ("learner.weight_decay=inf", "$.learner.weight_decay"),
    ("learner.grad_clip=nan", "$.learner.grad_clip"),
    ("learner.grad_clip=inf", "$.learner.grad_clip"),
    ("learner.contract_max_kl_k3=inf", "$.learner.contract_max_kl_k3"),
    ("model.pretrain_lr=inf", "$.model.pretrain_lr"),
    ("model.hidden_size=5", "$.model.hidden_size"),
    ("model.hidden_size=0", "$.model.hidden_size"),
    ("model.hidden_size=132", "$.model.hidden_size"),  # head_dim 33: RoPE needs an even one
    ("model.num_heads=3", "$.model.num_heads"),
    ("model.num_kv_heads=3", "$.model.num_kv_heads"),
    ("model.max_position_embeddings=4", "$.model.max_position_embeddings"),
    ("actor.max_new_tokens=128", "$.actor.max_new_tokens"),  # = the built-in's 128 positions: no prompt
    ("actor.max_new_tokens=0", "$.actor.max_new_tokens"),
    ("actor.top_p=nan", "$.actor.top_p"),
    ("actor.length_clip_rate=inf", "$.actor.length_clip_rate"),
    ("actor.sglang.mem_fraction=nan", "$.actor.sglang.mem_fraction"),
    ("actor.sglang.start_timeout_s=inf", "$.actor.sglang.start_timeout_s"),
    ("net.buffer_actor_port=70000", "$.net.buffer_actor_port"),
    ("net.buffer_actor_port=-1", "$.net.buffer_actor_port"),
    ("net.buffer_learner_port=65536", "$.net.buffer_learner_port"),
    ("buffer.max_frame_bytes=10", "$.buffer.max_frame_bytes"),
    ("buffer.max_frame_bytes=65535", "$.buffer.max_frame_bytes"),
    ("buffer.capacity_bytes=0", "$.buffer.capacity_bytes"),
    ("run.seed=-1", "$.run.seed"),
    ("run.seed=4294967296", "$.run.seed"),
    ("run.run_dir=/proc/x", "$.run.run_dir"),
    ("run.run_dir=/sys/x/y", "$.run.run_dir"),
    ("run.max_time_s=inf", "$.run.max_time_s"),
    ("run.max_time_s=nan", "$.run.max_time_s"),
    ("run.ckpt_every_s=inf", "$.run.ckpt_every_s"),
    ("run.heartbeat_timeout_s=-inf", "$.run.heartbeat_timeout_s"),
    ("task.reward_timeout_s=inf", "$.task.reward_timeout_s"),
    ("task.eval_frac=nan", "$.task.eval_frac"),
    ("ray.actor_gpus=inf", "$.ray.actor_gpus"),
    ("ray.learner_resources={node2=nan}", "$.ray.learner_resources"),
    ("ray.buffer_resources={node2=inf}", "$.ray.buffer_resources"),
    ("control.guard_kl_k3=inf", "$.control.guard_kl_k3"),
    ("control.ratio_p99_target=0.9", "$.control.ratio_p99_target"),
    ("control.ratio_p99_target=inf", "$.control.ratio_p99_target"),
    ("control.hysteresis=nan", "$.control.hysteresis"),
    ("monitor.refresh_s=inf", "$.monitor.refresh_s"),
    ("distill.lr=inf", "$.distill.lr"),
    ("weightsync.join_timeout_s=inf", "$.weightsync.join_timeout_s"),
    ("pipeline.rl1={learner={lr=inf}}", "$.pipeline.rl1.learner.lr"),  # a stage's partial config too
]


@pytest.mark.parametrize("override, path", HOSTILE, ids=[o for o, _ in HOSTILE])
def test_a_hostile_value_is_refused_naming_its_field(override, path):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, [override])
    assert path in str(e.value)


def test_defaults_and_legitimate_values_still_load(tmp_path):
    assert C.load() == C.Config()
    cfg = C.load(None, ["learner.lr=3e-5", "learner.betas=[0.0, 0.999]", "actor.temperature=0.7",
                        "net.buffer_actor_port=65535", "net.buffer_learner_port=5555", "run.seed=4294967295",
                        "buffer.max_frame_bytes=65536", "model.hidden_size=64", "model.num_kv_heads=1",
                        "model.max_position_embeddings=9", "control.ratio_p99_target=1.01", "learner.eps_clip=0.5",
                        "ray.learner_resources={node2=0.5}", f"run.run_dir={tmp_path}/new/sub"])
    assert cfg.learner.betas == (0.0, 0.999) and cfg.net.buffer_actor_port == 65535 and cfg.run.seed == 2**32 - 1
    assert not os.path.exists(tmp_path / "new")  # checked, not created
    # a checkpoint's context is its own (read at launch): the built-in's positions do not bound it
    assert C.load(None, ["model.path=/ckpt", "actor.max_new_tokens=1024"]).actor.max_new_tokens == 1024
    assert C.from_json(C.to_json(cfg)) == cfg


def test_run_dir_under_a_file_or_a_read_only_dir_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(C.ConfigError, match=r"\$\.run\.run_dir"):
        C.load(None, [f"run.run_dir={tmp_path}/f/run"])
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(C.ConfigError, match=r"\$\.run\.run_dir"):
            C.load(None, [f"run.run_dir={tmp_path}/ro/a/b"])


def test_toml_file_that_is_not_utf8_is_a_config_error(tmp_path):
    p = tmp_path / "c.toml"
    p.write_bytes(b"[learner]\nlr = 0.5  # caf\xe9\n")
    with pytest.raises(C.ConfigError, match="not UTF-8"):
        C.load(str(p))


def test_a_checkpoint_context_is_read_and_must_leave_room_for_a_prompt(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50, "max_position_embeddings": 8}))
    cfg = C.load(None, [f"model.path={tmp_path}", "actor.max_new_tokens=7"])
    m = jobs.resolve_model(cfg).model
    assert (m.vocab_size, m.context) == (50, 8)
    with pytest.raises(C.ConfigError, match="no room for a prompt"):
        jobs.resolve_model(C.load(None, [f"model.path={tmp_path}", "actor.max_new_tokens=8"]))


def test_run_py_reports_a_bad_value_in_one_line_and_creates_nothing(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "learner.lr=inf", f"run.run_dir={tmp_path}/x"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = (p.stdout + p.stderr).strip().splitlines()
    assert p.returncode == 2 and len(out) == 1 and "$.learner.lr" in out[0], out
    assert os.listdir(tmp_path) == []  # neither x nor runs/
