"""The pipeline's pure parts (pipeline.py): each stage's config is the recipe's, the user's
tables go on top with their field paths in errors, a finished stage is never pending again; and
the pieces it relies on -- map fields in the config take the user's keys, a model without a chat
template sees its tier's system prompt, pre-training prompts carry the tier prompts at random."""

import random

import msgspec
import pytest

import pipeline as P
from core import config as C


def _configs(*overrides, out="/p"):
    base = msgspec.to_builtins(C.load(None, ["task.name=scratch", "task.digits=5", "task.min_digits=2",
                                             "actor.max_new_tokens=20", "model.path=/base",
                                             'pipeline.tiers.task.system_prompt={low="l ", medium="m ", high="h "}',
                                             "pipeline.tiers.task.tier_max_new_tokens={low=8, medium=12, high=16}",
                                             *overrides]))
    return P.all_configs(base, out)


def test_each_stage_has_the_recipes_loss_settings_and_starts_from_the_stage_before():
    c = _configs()
    rl1, rl2, tiers = c["rl1"].learner, c["rl2"].learner, c["tiers"].learner
    assert (rl1.norm, rl1.kl_estimator, c["rl1"].actor.length_schedule) == ("token", "k3", "steps") and rl1.kl_beta > 0
    assert (rl2.norm, rl2.kl_beta, c["rl2"].actor.length_schedule) == ("sample", 0.0, "off")
    assert (tiers.norm, tiers.kl_beta) == ("sample", 0.0)
    assert [c[s].model.path for s in P.STAGES] == ["/base", "/p/rl1/final_model", "/p/distill/model",
                                                    "/p/rl2/final_model"]
    assert [c[s].run.run_dir for s in P.STAGES] == [f"/p/{s}" for s in P.STAGES]
    assert c["tiers"].task.tier_max_new_tokens == {"low": 8, "medium": 12, "high": 16}
    assert c["rl2"].task.system_prompt == {} and c["rl2"].task.tier_max_new_tokens == {}  # tiers only
    assert all(c[s].run.stage for s in P.STAGES)  # the live view's title


def test_the_users_stage_tables_win_over_the_recipe_and_bad_keys_name_their_path():
    c = _configs("pipeline.rl1.learner.kl_beta=0.05", "pipeline.rl2.learner.lr=3e-5", "learner.lr=2e-4")
    assert c["rl1"].learner.kl_beta == 0.05 and c["rl2"].learner.lr == 3e-5 and c["tiers"].learner.lr == 2e-4
    with pytest.raises(C.ConfigError, match=r"\$\.pipeline\.rl2\.learner\.nrom"):
        _configs("pipeline.rl2.learner.nrom=1")
    with pytest.raises(C.ConfigError, match="kl_beta"):
        _configs("pipeline.rl1.learner.kl_beta=0.0")
    with pytest.raises(C.ConfigError, match="task.system_prompt.high"):
        _configs('pipeline.tiers.task.system_prompt={low="l "}')
    with pytest.raises(C.ConfigError, match="exceeds"):  # a tier limit above the cap the buffer admits
        _configs("pipeline.tiers.task.tier_max_new_tokens={low=8, medium=12, high=40}")


def test_a_finished_stage_is_never_pending_again():
    state = {"stages": {"rl1": {"status": "done"}, "distill": {"status": "done"}, "rl2": {"status": "running"}}}
    assert P.pending(state) == ["rl2", "tiers"]
    assert P.pending({"stages": {}}) == list(P.STAGES)


def test_map_fields_take_new_keys_and_sections_do_not():
    c = C.load(None, ['task.system_prompt.low="be brief "', "task.tier_max_new_tokens.high=6"])
    assert c.task.system_prompt == {"low": "be brief "} and c.task.tier_max_new_tokens == {"high": 6}
    with pytest.raises(C.ConfigError, match=r"`\$\.task\.system_promtp`"):
        C.load(None, ['task.system_promtp.low="x"'])
    with pytest.raises(C.ConfigError, match="tiers are"):
        C.load(None, ["task.tier_max_new_tokens.hard=6"])


def test_a_plain_text_model_sees_its_tiers_system_prompt_and_pretraining_draws_the_prefixes():
    from actor.tasks import make_task
    from actor.tasks.arith import build_tokenizer, special_ids
    from actor.tasks.scratch import CHARS
    from model.basemodel import _prefixed
    from model.tokenizer import Tokenizer

    tok = Tokenizer.build(build_tokenizer(CHARS), special_ids(), {}, {})
    cfg = C.load(None, ["task.name=scratch", 'task.system_prompt={high="h "}'])
    task = make_task(cfg.task, tok)
    rng = random.Random(0)
    p = next(p for p in iter(lambda: task.sample(rng), None) if p.tier == "high")
    assert tok.decode(p.tokens) == "h " + p.id + "="
    q = next(p for p in iter(lambda: task.sample(rng), None) if p.tier == "low")
    assert tok.decode(q.tokens) == q.id + "="  # no prompt for low: none
    seen = {tok.decode(_prefixed(list(q.tokens), tok, rng, ["", "l ", "h "])) for _ in range(60)}
    assert seen == {f"{pre}{q.id}=" for pre in ("", "l ", "h ")}
    assert _prefixed(list(q.tokens), tok, rng, []) == list(q.tokens)


def test_tiers_by_pass_rate_rank_the_difficulties_from_easiest_in_thirds():
    acc = {"0.0": 0.9, "0.25": 0.1, "0.5": 0.6, "0.75": 0.6, "1.0": 0.05, "0.1": 0.7}
    tiers = P.pass_rate_tiers({d: {"accuracy": a} for d, a in acc.items()})
    assert tiers == {"0.0": "low", "0.1": "low", "0.5": "medium", "0.75": "medium", "0.25": "high", "1.0": "high"}
    from actor.tasks import make_task
    from actor.tasks.arith import build_tokenizer, special_ids
    from actor.tasks.scratch import CHARS
    from model.tokenizer import Tokenizer

    cfg = C.load(None, ["task.name=scratch", "task.min_digits=2", "task.digits=3",
                        'task.difficulty_tiers={"0.0" = "high"}', 'task.system_prompt={high="h "}'])
    task = make_task(cfg.task, Tokenizer.build(build_tokenizer(CHARS), special_ids(), {}, {}))
    rng = random.Random(3)
    prompts = [task.sample(rng) for _ in range(50)]
    assert {p.tier for p in prompts if p.difficulty == 0.0} == {"high"}  # re-tiered, with its prompt
    assert all(task.tok.decode(p.tokens).startswith("h ") for p in prompts if p.difficulty == 0.0)
    assert {p.tier for p in prompts if p.difficulty == 1.0} == {"high"}  # by level, as before
    with pytest.raises(C.ConfigError, match="difficulty_tiers"):
        C.load(None, ['task.difficulty_tiers={"0.0" = "hard"}'])


def test_the_shipped_default_pipeline_builds_every_stage():
    base = msgspec.to_builtins(C.load(P.DEFAULT_CONFIG, ["model.path=/b"]))
    c = P.all_configs(base, "/p")
    assert c["rl1"].task.name == "scratch" and c["rl1"].learner.kl_beta > 0
    assert set(c["tiers"].task.system_prompt) == set(P.TIERS)
    # the tier prompts are what the base model saw, at random, before every pre-training prompt
    assert set(c["tiers"].task.system_prompt.values()) <= set(c["rl1"].model.pretrain_prompt_prefixes)
    assert all(c[s].run.max_steps > 0 for s in ("rl1", "rl2", "tiers"))
