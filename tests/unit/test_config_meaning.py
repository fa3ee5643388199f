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
    # more floats that are not finite, or outside their range
    ("learner.contract_max_abs_logp_diff=nan", "$.learner.contract_max_abs_logp_diff"),
    ("learner.eps_high=nan", "$.learner.eps_high"),
    ("learner.eps_high=-1", "$.learner.eps_high"),
    ("learner.weight_decay=-0.1", "$.learner.weight_decay"),
    ("learner.kl_beta=-1", "$.learner.kl_beta"),
    ("actor.temperature=-1", "$.actor.temperature"),
    ("actor.temperature=nan", "$.actor.temperature"),
    ("actor.top_p=0", "$.actor.top_p"),
    ("actor.top_p=1.5", "$.actor.top_p"),
    ("actor.length_clip_rate=0", "$.actor.length_clip_rate"),
    ("actor.sglang.mem_fraction=1", "$.actor.sglang.mem_fraction"),
    ("actor.sglang.request_timeout_s=0", "$.actor.sglang.request_timeout_s"),
    ("actor.sglang.update_timeout_s=-inf", "$.actor.sglang.update_timeout_s"),
    ("model.pretrain_correct_frac=1.5", "$.model.pretrain_correct_frac"),
    ("model.pretrain_worked_frac=-0.1", "$.model.pretrain_worked_frac"),
    ("model.pretrain_redundant_frac=nan", "$.model.pretrain_redundant_frac"),
    ("model.pretrain_lr=0", "$.model.pretrain_lr"),
    ("task.eval_frac=0", "$.task.eval_frac"),
    ("task.eval_frac=1", "$.task.eval_frac"),
    ("task.reward_timeout_s=0", "$.task.reward_timeout_s"),
    ("run.restart_backoff_s=-1", "$.run.restart_backoff_s"),
    ("run.restart_backoff_s=nan", "$.run.restart_backoff_s"),
    ("run.ckpt_every_s=-1", "$.run.ckpt_every_s"),
    ("run.max_time_s=-1", "$.run.max_time_s"),
    ("run.heartbeat_timeout_s=nan", "$.run.heartbeat_timeout_s"),
    ("ray.actor_cpus=0", "$.ray.actor_cpus"),
    ("ray.learner_cpus=nan", "$.ray.learner_cpus"),
    ("ray.buffer_cpus=-1", "$.ray.buffer_cpus"),
    ("ray.learner_gpus=-inf", "$.ray.learner_gpus"),
    ("ray.start_timeout_s=0", "$.ray.start_timeout_s"),
    ("ray.actor_resources={GPU=1}", "$.ray.actor_resources"),  # GPUs have their own field
    ("ray.actor_resources={node2=0}", "$.ray.actor_resources"),
    ("monitor.plain_every_s=0", "$.monitor.plain_every_s"),
    ("control.hysteresis=1", "$.control.hysteresis"),
    ("control.guard_ratio_p99=0.5", "$.control.guard_ratio_p99"),  # would fire on every clean step
    ("control.guard_ratio_min=2", "$.control.guard_ratio_min"),
    ("control.guard_abs_logp_diff_p99_s0=nan", "$.control.guard_abs_logp_diff_p99_s0"),
    ("control.guard_ratio_max=-inf", "$.control.guard_ratio_max"),
    ("distill.lr=nan", "$.distill.lr"),
    ("weightsync.join_timeout_s=0", "$.weightsync.join_timeout_s"),
    # negative sizes, zero where at least one is needed, out-of-range integers
    ("run.max_steps=-5", "$.run.max_steps"),
    ("run.eval_prompts=0", "$.run.eval_prompts"),
    ("task.digits=0", "$.task.digits"),
    ("task.digits=13", "$.task.digits"),
    ("task.min_digits=0", "$.task.min_digits"),
    ("task.size=0", "$.task.size"),
    ("task.reward_workers=0", "$.task.reward_workers"),
    ("model.num_layers=0", "$.model.num_layers"),
    ("model.intermediate_size=-1", "$.model.intermediate_size"),
    ("model.max_position_embeddings=0", "$.model.max_position_embeddings"),
    ("model.pretrain_batch=0", "$.model.pretrain_batch"),
    ("actor.group_size=1", "$.actor.group_size"),  # no advantage within a group of one
    ("actor.num_actors=0", "$.actor.num_actors"),
    ("actor.num_actors=3", "$.actor.num_actors"),  # 16 groups per step do not split in 3
    ("actor.threads=0", "$.actor.threads"),
    ("actor.max_batch=0", "$.actor.max_batch"),
    ("actor.top_k=-1", "$.actor.top_k"),
    ("actor.length_start=0", "$.actor.length_start"),
    ("actor.length_window=0", "$.actor.length_window"),
    ("buffer.capacity_groups=0", "$.buffer.capacity_groups"),
    ("buffer.max_staleness=-1", "$.buffer.max_staleness"),
    ("buffer.max_prompt_tokens=0", "$.buffer.max_prompt_tokens"),
    ("learner.micro_batch_tokens=-1", "$.learner.micro_batch_tokens"),
    ("learner.tail_k=-1", "$.learner.tail_k"),
    ("learner.logprob_chunk=0", "$.learner.logprob_chunk"),
    ("learner.context_parallel=0", "$.learner.context_parallel"),
    ("learner.context_parallel=-2", "$.learner.context_parallel"),
    ("learner.context_parallel=5000", "$.learner.context_parallel"),  # above prompt + completion tokens
    ("learner.context_parallel=1.5", "$.learner.context_parallel"),
    ("control.staleness_min=9", "$.control.staleness_min"),  # above staleness_max = 8
    ("control.pause_steps=0", "$.control.pause_steps"),
    ("distill.samples=1", "$.distill.samples"),
    ("distill.epochs=0", "$.distill.epochs"),
    ("distill.batch=0", "$.distill.batch"),
    ("distill.prompts=0", "$.distill.prompts"),
    ("weightsync.bucket_mb=0", "$.weightsync.bucket_mb"),
    # literals that are not one of the choices, wrong types, lists and tables for scalars
    ("monitor.live=maybe", "$.monitor.live"),
    ("control.guard_action=explode", "$.control.guard_action"),
    ("buffer.policy=random", "$.buffer.policy"),
    ("buffer.fsync=sometimes", "$.buffer.fsync"),
    ("buffer.persist=yes", "$.buffer.persist"),
    ("learner.norm=tokens", "$.learner.norm"),
    ("learner.kl_estimator=k4", "$.learner.kl_estimator"),
    ("learner.body_dtype=float64", "$.learner.body_dtype"),
    ("actor.dtype=int8", "$.actor.dtype"),
    ("actor.fp32_attn_softmax=maybe", "$.actor.fp32_attn_softmax"),
    ("task.chat_template=yes", "$.task.chat_template"),
    ("pipeline.tier_by=random", "$.pipeline.tier_by"),
    ("ray.placement_strategy=RANDOM", "$.ray.placement_strategy"),
    ("metrics.tensorboard=2", "$.metrics.tensorboard"),
    ("learner.lr=fast", "$.learner.lr"),
    ('learner.lr="fast"', "$.learner.lr"),
    ("learner.lr=true", "$.learner.lr"),
    ("learner.lr=[1e-4]", "$.learner.lr"),
    ("learner.lr={a=1}", "$.learner.lr"),
    ("learner.groups_per_step=2.5", "$.learner.groups_per_step"),
    ("run.seed=1.5", "$.run.seed"),
    ('run.seed="0"', "$.run.seed"),
    ("learner.betas=[0.9]", "$.learner.betas"),
    ("learner.betas=[0.9, 0.99, 0.999]", "$.learner.betas"),
    ("learner.betas=0.9", "$.learner.betas"),
    ('actor.device=["cpu", 3]', "$.actor.device"),
    ("pipeline.rl1=5", "$.pipeline.rl1"),
    ("learner=1", "$.learner"),  # a value for a whole section
    # unknown keys, and what is not an override at all
    ("learner.nope=1", "$.learner.nope"),
    ("nope.x=1", "$.nope"),
    ("learner.lr.x=1", "$.learner.lr.x"),
    ("learner.lr", "learner.lr"),  # no `=`
    # tiers that are not tiers, token limits over the cap
    ('task.system_prompt={extreme="x"}', "$.task.system_prompt"),
    ('task.difficulty_tiers={"1"="ultra"}', "$.task.difficulty_tiers"),
    ("task.tier_max_new_tokens={low=100}", "$.task.tier_max_new_tokens"),  # above actor.max_new_tokens = 8
    # hosts and keys
    ("net.host=not-a-host", "$.net.host"),
    ("net.host=127.evil", "$.net.host"),
    ("net.host=10.0.0.1", "$.net.host"),  # off loopback without CURVE
    ("net.curve_server_public=abc", "$.net.curve_server_public"),  # without its secret
    ("net.curve_client_secret=short", "$.net.curve_client_secret"),
]
# values that load, but name no registered implementation: refused at launch (jobs.check_seams),
# before anything is created
SEAMS = [
    ("run.launcher=slurm", "$.run.launcher"),
    ("learner.loss=nope", "$.learner.loss"),
    ("learner.backend=nope", "$.learner.backend"),
    ("task.name=nope", "$.task.name"),
    ("actor.engine=nope", "$.actor.engine"),
    ("weightsync.transport=pigeon", "$.weightsync.transport"),
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


class _GotThrough(BaseException):
    """A hostile value reached the model's resolution: past every check, about to build and run."""


@pytest.fixture
def run_main_in_process(tmp_path, monkeypatch):
    """``run.main`` in this process, in an empty cwd, with its process-wide side effects undone:
    the root logger's handlers and level (logging.basicConfig), the SIGINT/SIGTERM handlers
    (launchers.Interrupt.install); a value that got past every check stops before it builds a model."""
    import logging
    import signal

    import run
    from core import launchers

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launchers.Interrupt, "signalled", False)

    def got_through(cfg):
        raise _GotThrough(cfg)

    monkeypatch.setattr(jobs, "resolve_model", got_through)

    def main(argv):
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        try:
            return run.main(argv)
        finally:  # basicConfig adds a handler only to a bare root logger (not under pytest's capture)
            for h in [h for h in root.handlers if h not in handlers]:
                root.removeHandler(h)
            root.setLevel(level)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield main
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)


def test_a_hundred_hostile_values_each_exit_2_in_one_line_creating_nothing(tmp_path, capsys, run_main_in_process):
    """Every hostile value through the command line's own entry (``run.main``, in-process): exit 2,
    one stderr line naming the field, and neither the run dir nor ``runs/`` (nor anything) created."""
    cases = HOSTILE + SEAMS
    assert len({o for o, _ in cases}) == len(cases) >= 100
    with pytest.raises(_GotThrough):  # the control: a legitimate value goes on to build the model
        run_main_in_process([f"run.run_dir={tmp_path}/x", "learner.lr=3e-5"])
    assert os.listdir(tmp_path) == [] and capsys.readouterr().err == ""
    failures = []
    for override, path in cases:
        # the run dir first: a hostile run.run_dir override must stay the one that counts
        try:
            code = run_main_in_process([f"run.run_dir={tmp_path}/x", override])
        except _GotThrough:
            code = "got past every check"
        out, err = capsys.readouterr()
        lines = err.splitlines()
        named = len(lines) == 1 and (path in lines[0] or path.removeprefix("$.") in lines[0])
        made = os.listdir(tmp_path)
        if code != 2 or out or not named or made:
            failures.append(f"{override!r}: exit {code}, stdout {out!r}, stderr {lines}, created {made}")
    assert not failures, "\n".join(failures)


NEWLINE_KEYS = [  # a key the user typed, echoed into the message: escaped, never a second stderr line
    ("learner.x\ny=1", "$.learner.x"),  # core/config.py apply_override: unknown config key
    (r'ray.actor_resources={"x\ny"=nan}', "$.ray.actor_resources"),  # TOML's escape; _check_finite's path
    (r'pipeline.rl1={"a\nb"={lr=inf}}', "$.pipeline.rl1"),
]


@pytest.mark.parametrize("override, path", NEWLINE_KEYS, ids=["unknown_key", "map_key", "stage_key"])
def test_a_key_with_a_newline_is_still_reported_in_one_line(tmp_path, capsys, run_main_in_process, override, path):
    assert run_main_in_process([f"run.run_dir={tmp_path}/x", override]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and path in lines[0], lines
    assert os.listdir(tmp_path) == []
