"""Tail forensics (learner/tail.py, learner/tailview.py): which tokens are picked, where they sit,
how old they are, the per-step line, and the viewer's summary counts."""

import json
import math
import os
import time

import pytest
import torch

from learner import tail as T
from learner import tailview as V
from learner.batching import collate
from learner.checkpoint import WriteError
from tests.support.tiny import make_group, tiny_cfg, tiny_tokenizer

torch.set_num_threads(1)


def _decode(ids):
    return [f"<{i}>" for i in ids]


def _batch(learner_version=3):
    """Two groups of two samples; prompts of 3 and 2 tokens, ragged completions (padding).
    At version 3, a0:0's samples are 2 (versions 1-2) and 1 (version 2) stale; a1:5's are fresh."""
    g0 = make_group([1, 7, 11], [([20, 21, 22], [-1.0, -1.1, -1.2], [1, 2, 2], "stop", 1.0),
                                 ([23], [-1.3], [2], "stop", 0.0)], seq=0, actor_id="a0")
    g1 = make_group([1, 9], [([30, 31], [-2.0, -2.1], [3, 3], "stop", 1.0),
                             ([32, 33, 34, 35], [-2.2, -2.3, -2.4, -2.5], [3, 3, 3, 3], "length", 0.0)],
                    seq=5, actor_id="a1")
    return collate([g0, g1], learner_version)


# log-ratio of every completion token, by (row, position in the response)
DELTAS = {(0, 0): 0.10, (0, 1): -0.30, (0, 2): 0.90, (1, 0): 0.05,
          (2, 0): -1.20, (2, 1): 0.0, (3, 0): 0.40, (3, 1): -0.02, (3, 2): 0.20, (3, 3): -0.60}


def _logp(batch):
    """Learner log-probs = behaviour + DELTAS on the response; +50 on every prompt and padding
    column, so picking any of them would be the largest "high" of all."""
    logp = torch.full(batch.mask.shape, 50.0)
    start = (batch.mask > 0).int().argmax(dim=1).tolist()  # each row's first response column
    for (r, p), d in DELTAS.items():
        logp[r, start[r] + p] = batch.behaviour_logp[r, start[r] + p] + d
    return logp


def _records(k, batch=None):
    batch = batch or _batch()
    return T.records(batch, _logp(batch), step=4, version=3, k=k, decode=_decode)


def test_picks_the_largest_and_smallest_ratios_in_order():
    recs = _records(k=2)
    assert [(r["direction"], r["group"], r["sample"], r["position"]) for r in recs] == [
        ("high", "a0:0", 0, 2), ("high", "a1:5", 1, 0), ("low", "a1:5", 0, 0), ("low", "a1:5", 1, 3)]
    top = recs[0]
    assert top["log_ratio"] == pytest.approx(0.90, abs=1e-5)
    assert top["ratio"] == pytest.approx(math.exp(0.90), rel=1e-5)
    assert top["logp"] - top["behaviour_logp"] == pytest.approx(top["log_ratio"], abs=1e-5)
    assert top["behaviour_logp"] == pytest.approx(-1.2, abs=1e-6)
    assert list(top) == list(T.RECORD_FIELDS)


def test_positions_lengths_tokens_and_staleness():
    by_token = {r["token_id"]: r for r in _records(k=8)}
    assert (by_token[22]["position"], by_token[22]["length"], by_token[22]["text"]) == (2, 3, "<22>")
    assert (by_token[35]["position"], by_token[35]["length"]) == (3, 4)
    assert (by_token[23]["position"], by_token[23]["length"], by_token[23]["sample"]) == (0, 1, 1)
    # per token (version 3 - the token's own version), not the sample's oldest (2, 2, 2, 1)
    assert [by_token[t]["staleness"] for t in (20, 21, 22, 23)] == [2, 1, 1, 1]
    assert {by_token[t]["prompt_id"] for t in (20, 23)} == {"a0-0"} and by_token[35]["prompt_id"] == "a1-5"
    assert {r["staleness"] for r in by_token.values() if r["group"] == "a1:5"} == {0}
    assert all(r["step"] == 4 and r["version"] == 3 for r in by_token.values())


def test_prompt_and_padding_never_picked_and_k_beyond_the_token_count():
    recs = _records(k=100)
    assert len(recs) == len(DELTAS) - 1  # every response token once, but the one with ratio exactly 1
    assert all(abs(r["log_ratio"]) < 1.5 for r in recs)  # never a +50 prompt/padding column
    assert {r["token_id"] for r in recs} == {20, 21, 22, 23, 30, 32, 33, 34, 35}
    assert all((r["direction"] == "high") == (r["ratio"] > 1) for r in recs)


def test_k_zero_is_off():
    assert _records(k=0) == []
    assert T.writer_for(tiny_cfg("learner.tail_k=0"), "/nonexistent") is None
    from core.config import ConfigError

    with pytest.raises(ConfigError, match="tail_k"):  # validated with the config
        tiny_cfg("learner.tail_k=-1")


def test_sample_staleness_without_versions_and_shape_errors():
    batch = _batch()
    batch.staleness, batch.versions = torch.tensor([7, 0, 0, 0]), None  # no versions: the sample's staleness
    recs = T.records(batch, _logp(batch), step=1, version=3, k=1, decode=_decode)
    assert recs[0]["token_id"] == 22 and recs[0]["staleness"] == 7
    with pytest.raises(ValueError, match="must be shaped like the batch's mask"):
        T.records(batch, _logp(batch)[:, :-1], step=1, version=3, k=1, decode=_decode)


def test_real_tokenizer_decodes_special_tokens():
    tok = tiny_tokenizer()
    texts = T.token_decoder(tok)([tok.encode("7")[0], tok.eos_id])
    assert texts[0] == "7" and texts[1] != ""  # EOS is shown, not skipped


def test_writer_appends_one_json_line_per_step(tmp_path):
    w = T.TailWriter(str(tmp_path), 2, _decode)
    batch = _batch()
    for step in (1, 2):
        w.write(step, step - 1, batch, _logp(batch))
    lines = [json.loads(line) for line in open(tmp_path / T.TAIL_FILE)]
    assert [line["step"] for line in lines] == [1, 2] and lines[1]["version"] == 1
    assert lines[0]["tokens"] == batch.num_tokens == len(DELTAS) and lines[0]["k"] == 2
    assert lines[0]["records"] == T.records(batch, _logp(batch), step=1, version=0, k=2, decode=_decode)
    with pytest.raises(WriteError, match="tail log"):
        T.TailWriter(str(tmp_path / "missing"), 2, _decode).write(1, 0, batch, _logp(batch))


def test_backend_keeps_the_steps_logprobs():
    from learner.backends.torch import TorchBackend
    from tests.support.tiny import tiny_model_dir

    cfg = tiny_cfg("learner.groups_per_step=2", "actor.group_size=2", "learner.body_dtype=float32")
    backend = TorchBackend(cfg, tiny_model_dir())
    batch = _batch()
    backend.forward_backward(batch)
    with torch.no_grad():
        ref, _ = backend.logprobs(batch)
    assert backend.last_logp.shape == batch.mask.shape and not backend.last_logp.requires_grad
    assert torch.allclose(backend.last_logp, ref, atol=1e-4)
    assert torch.all(backend.last_logp[batch.mask == 0] == 0)


# ---- the viewer ------------------------------------------------------------------------------


def _rec(step, direction, log_ratio, token_id, position, length, staleness):
    return {"step": step, "version": step - 1, "direction": direction, "ratio": math.exp(log_ratio),
            "log_ratio": log_ratio, "logp": -1.0, "behaviour_logp": -1.0 - log_ratio, "token_id": token_id,
            "text": f"t{token_id}", "position": position, "length": length, "staleness": staleness,
            "group": "a0:0", "sample": 0}


def _steps():
    return [{"step": 1, "version": 0, "tokens": 40, "records": [
                _rec(1, "high", 0.5, 7, 0, 20, 0), _rec(1, "high", 0.2, 2, 19, 20, 1),
                _rec(1, "low", -0.4, 7, 10, 20, 1)]},
            {"step": 2, "version": 1, "tokens": 30, "records": [
                _rec(2, "high", 1.5, 2, 4, 5, 2), _rec(2, "low", -0.1, 9, 1, 5, 0)]}]


def test_summary_counts():
    s = V.summarise(_steps())
    assert (s["steps"], s["records"], s["tokens"], s["first_step"], s["last_step"]) == (2, 5, 70, 1, 2)
    assert [r["log_ratio"] for r in s["high"]] == [1.5, 0.5, 0.2]
    assert [r["log_ratio"] for r in s["low"]] == [-0.4, -0.1]
    st = s["by_staleness"]
    assert {k: (v["count"], v["high"], v["low"]) for k, v in st.items()} == {
        "0": (2, 1, 1), "1": (2, 1, 1), "2": (1, 1, 0)}
    assert st["1"]["share"] == pytest.approx(0.4)
    pos = s["by_position"]  # 0 of 20 first; 19 of 20 and 4 of 5 last; 10 of 20 and 1 of 5 middle
    assert {k: v["count"] for k, v in pos.items()} == {"first 10%": 1, "middle": 2, "last 10%": 2}
    assert pos["last 10%"]["share"] == pytest.approx(0.4)
    top = s["top_tokens"]
    assert [(t["token_id"], t["count"], t["high"], t["low"]) for t in top[:2]] == [(2, 2, 2, 0), (7, 2, 1, 1)]
    assert top[0]["mean_log_ratio"] == pytest.approx((0.2 + 1.5) / 2)
    assert [(b["first_step"], b["max_ratio"]) for b in s["trend"]] == [(1, math.exp(0.5)), (2, math.exp(1.5))]


def test_position_buckets():
    assert V.bucket(0, 1) == "first 10%"
    assert (V.bucket(0, 5), V.bucket(2, 5), V.bucket(4, 5)) == ("first 10%", "middle", "last 10%")
    assert (V.bucket(1, 20), V.bucket(2, 20), V.bucket(17, 20), V.bucket(18, 20)) == (
        "first 10%", "middle", "middle", "last 10%")


def _write(run_dir, steps, tail=""):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, T.TAIL_FILE), "w") as f:
        f.write("".join(json.dumps(s) + "\n" for s in steps) + tail)


def test_load_last_line_per_step_wins_last_n_and_torn_tail(tmp_path):
    steps = _steps()
    again = {**steps[1], "records": steps[1]["records"][:1]}  # step 2 trained again after a resume
    _write(tmp_path, [*steps, again], tail='{"step": 3, "rec')
    loaded = V.load(str(tmp_path))
    assert [s["step"] for s in loaded] == [1, 2] and len(loaded[1]["records"]) == 1
    assert [s["step"] for s in V.load(str(tmp_path), last=1)] == [2]


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        V.load(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="has no tail.jsonl"):
        V.load(str(tmp_path))
    _write(tmp_path, [], tail='not json\n{"step": 1, "records": []}\n')
    with pytest.raises(ValueError, match=r"tail.jsonl:1 is not a JSON line"):
        V.load(str(tmp_path))
    _write(tmp_path, [{"step": "x", "records": []}])
    with pytest.raises(ValueError, match="needs an int `step`"):
        V.load(str(tmp_path))


def test_plain_view_and_json_main(tmp_path, capsys):
    _write(tmp_path, _steps())
    text = V.plain(V.summarise(V.load(str(tmp_path))))
    assert "highest ratio (top 3)" in text and "'t2'" in text and "4/5" in text
    assert V.main([str(tmp_path), "--json", "--last", "1"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["steps"] == 1 and s["records"] == 2
    assert V.main([str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_loop_writes_a_line_per_step(tmp_path):
    from learner.loop import LearnerLoop
    from tests.unit.test_learner_loop import FakeClient, FakeSink, _group, _vocab

    cfg = tiny_cfg("learner.groups_per_step=2", "actor.group_size=4", "learner.body_dtype=float32",
                   "weightsync.transport=filesystem", f"model.vocab_size={_vocab()}", "learner.tail_k=3")
    loop = LearnerLoop(cfg, str(tmp_path), client=FakeClient(), metrics=FakeSink())
    try:
        m, batch = loop.train_step([_group(0), _group(1)])
        loop._emit(m, batch, 0.0, 0.1, time.time())
    finally:
        loop.close()
    (line,) = V.load(str(tmp_path))
    assert (line["step"], line["version"], line["k"]) == (1, 0, 3)
    assert 0 < len(line["records"]) <= 6
    assert all(set(r) == set(T.RECORD_FIELDS) for r in line["records"])


def test_rich_view_shows_markup_like_tokens_verbatim(capsys, monkeypatch):
    steps = _steps()
    steps[0]["records"][0]["text"] = "[/b]"
    monkeypatch.setenv("COLUMNS", "200")
    V.show_rich(V.summarise(steps))
    assert "'[/b]'" in capsys.readouterr().out


def test_a_deep_line_or_a_fifo_is_refused_in_a_line_not_a_recursion_or_a_hang(tmp_path):
    _write(tmp_path, [], tail="[" * 100_000 + '\n{"step": 1, "records": []}\n')
    with pytest.raises(ValueError, match="nested deeper"):
        V.load(str(tmp_path))
    os.unlink(tmp_path / T.TAIL_FILE)
    os.mkfifo(tmp_path / T.TAIL_FILE)
    with pytest.raises(ValueError, match="not a regular file"):
        V.load(str(tmp_path))
