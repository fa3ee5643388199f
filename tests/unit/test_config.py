import pytest

from core import config as C


def test_defaults_are_valid_and_round_trip_json():
    cfg = C.load()
    assert cfg.buffer.max_staleness >= 0
    assert C.from_json(C.to_json(cfg)) == cfg


def test_dotted_overrides_parse_toml_literals():
    cfg = C.load(None, ["learner.lr=2e-6", "buffer.max_staleness=4", "buffer.persist=false",
                        "learner.betas=[0.8, 0.95]", "learner.loss=ppo_clip"])
    assert cfg.learner.lr == 2e-6
    assert cfg.buffer.max_staleness == 4
    assert cfg.buffer.persist is False
    assert cfg.learner.betas == (0.8, 0.95)
    assert cfg.learner.loss == "ppo_clip"


def test_toml_file_then_overrides(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[learner]\nlr = 0.5\ngroups_per_step = 4\n[actor]\ngroup_size = 4\n")
    cfg = C.load(str(p), ["learner.lr=0.25"])
    assert cfg.learner.lr == 0.25 and cfg.learner.groups_per_step == 4 and cfg.actor.group_size == 4


@pytest.mark.parametrize("override, path", [
    ("learner.lrx=1", "$.learner.lrx"),
    ("nosuch.key=1", "$.nosuch"),
    ("learner.lr=abc", "$.learner.lr"),
    ("buffer.max_staleness=-1", "$.buffer.max_staleness"),
    ("learner.norm=seq", "$.learner.norm"),  # (learner.loss: a seam key, checked by jobs.check_seams)
    ("actor.group_size=1", "$.actor.group_size"),
])
def test_bad_keys_and_values_name_the_field_path(override, path):
    with pytest.raises(C.ConfigError) as e:
        C.load(None, [override])
    assert path in str(e.value)


def test_unknown_key_in_toml_is_rejected(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[buffer]\nmax_stalenes = 3\n")
    with pytest.raises(C.ConfigError, match=r"\$\.buffer\.max_stalenes"):
        C.load(str(p))


def test_override_without_equals_and_cross_field_rules():
    with pytest.raises(C.ConfigError, match="section.key=value"):
        C.load(None, ["learner.lr"])
    with pytest.raises(C.ConfigError, match="multiple"):
        C.load(None, ["actor.num_actors=3", "learner.groups_per_step=8"])
    with pytest.raises(C.ConfigError, match="budget"):
        C.load(None, ["run.max_steps=0", "run.max_time_s=0"])


def test_non_loopback_host_needs_curve_keys():
    with pytest.raises(C.ConfigError, match="CURVE"):
        C.load(None, ["net.host=0.0.0.0"])
