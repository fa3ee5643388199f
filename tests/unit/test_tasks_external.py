"""The external tasks with their real scorers: reasoning-gym items scored by reasoning-gym,
JSONL math problems by math-verify, both through the reward pool; splits, tiers and bad input."""

import json
import random
import sys

import msgspec
import pytest

from actor.tasks import make_task
from actor.tasks.gym import difficulty_of
from actor.tasks.mathfile import load_problems, score as math_score
from core import config as C
from tests.support.textmodel import text_tokenizer


def _cfg(**fields):
    return msgspec.structs.replace(C.Config().task, reward_workers=1, **fields)


def _ids(task, text, eos=True):
    return task.tok.encode(text) + ([task.tok.eos_id] if eos else [])


@pytest.fixture(scope="module")
def gym():
    task = make_task(_cfg(name="gym", datasets=["basic_arithmetic", "chain_sum"]), text_tokenizer())
    yield task
    task.close()


def test_gym_answers_are_scored_by_reasoning_gym(gym):
    p = gym.sample(random.Random(0))
    wrong = str(int(p.answer) + 1)
    items = [(p, _ids(gym, p.answer)), (p, _ids(gym, wrong)), (p, _ids(gym, f"so <answer>{p.answer}</answer>")),
             (p, _ids(gym, p.answer, eos=False))]
    assert gym.rewards(items) == [1.0, 0.0, 1.0, 0.0]
    assert gym.metrics() == {"reward/checks": 3.0, "reward/timeouts": 0.0, "reward/errors": 0.0}  # truncated: unchecked
    assert gym.reward(p, _ids(gym, p.answer)) == 1.0


def test_gym_prompts_splits_and_tiers(gym):
    rng = random.Random(1)
    train = [gym.sample(rng) for _ in range(60)]
    evals = gym.eval_set(30)
    assert {p.id.split("-")[0] for p in train} == {"basic_arithmetic", "chain_sum"}  # a mix
    questions = lambda ps: {gym.tok.decode(p.tokens) for p in ps}  # noqa: E731
    assert questions(train).isdisjoint(questions(evals))
    assert [p.id for p in gym.eval_set(30)] == [p.id for p in evals]  # fixed
    assert all(p.tier in ("low", "medium", "high") and 0.0 <= p.difficulty <= 1.0 for p in train)
    assert len({p.tier for p in train}) >= 2
    text = gym.tok.tok.decode(list(train[0].tokens), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")  # the template


def test_difficulty_comes_from_the_items_place_in_the_configured_ranges():
    assert difficulty_of({"num_terms": 6, "num_digits": 1, "difficulty": {"num_terms": (2, 6), "num_digits": (1, 4)}}) \
        == (0.5, "medium")
    assert difficulty_of({"difficulty": {"num_terms": (2, 6)}, "num_terms": 2}) == (0.0, "low")
    assert difficulty_of({"difficulty": {"length": 10}}) == (0.0, "default")  # nothing to place
    assert difficulty_of({}) == (0.0, "default")


@pytest.mark.parametrize("datasets,match", [(["basic_arithmetc"], "unknown reasoning-gym dataset 'basic_arithmetc'; "
                                                                  "close matches: basic_arithmetic"),
                                            ([], "task.datasets is empty"),
                                            (["composite"], "composite")])
def test_gym_bad_dataset_names_are_clear_errors(datasets, match):
    with pytest.raises(ValueError, match=match):
        make_task(_cfg(name="gym", datasets=datasets), text_tokenizer())


def test_math_verify_scorer():
    cases = [("so \\boxed{1/2}", "0.5", 1.0), ("\\boxed{\\frac{1}{2}}", "1/2", 1.0), ("The answer is 42.", "42", 1.0),
             ("\\boxed{1/3}", "0.5", 0.0), ("no idea", "0.5", 0.0), ("$3\\sqrt{2}$", "3\\sqrt{2}", 1.0),
             ("\\boxed{3}", "3\\sqrt{2}", 0.0)]
    assert [math_score({"text": t, "answer": a, "budget_s": 10.0}) for t, a, _ in cases] == [c[2] for c in cases]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


ROWS = [{"prompt": f"What is {i}/2?", "answer": str(i / 2), "level": f"Level {1 + i % 5}", "id": f"p{i}"}
        for i in range(40)]


def test_math_task_scores_with_math_verify_through_the_pool(tmp_path):
    task = make_task(_cfg(name="math", path=_write(tmp_path / "train.jsonl", ROWS),
                          eval_path=_write(tmp_path / "eval.jsonl", ROWS[:5])), text_tokenizer())
    try:
        rng = random.Random(0)
        p = next(p for p in (task.sample(rng) for _ in range(2000)) if p.id == "p1")
        assert (p.answer, p.difficulty, p.tier) == ("0.5", 2.0, "low")
        out = task.rewards([(p, _ids(task, "\\boxed{1/2}")), (p, _ids(task, "\\boxed{2}")), (p, _ids(task, "1/2", False))])
        assert out == [1.0, 0.0, 0.0]
        assert {task.sample(rng, "eval").id for _ in range(40)} <= {f"p{i}" for i in range(5)}
        assert {task._tier(float(v)) for v in range(1, 6)} == {"low", "medium", "high"}
    finally:
        task.close()


def test_math_hashed_eval_split_is_disjoint_and_stable(tmp_path):
    path = _write(tmp_path / "rows.jsonl", ROWS)
    tasks = [make_task(_cfg(name="math", path=path, eval_frac=0.25), text_tokenizer()) for _ in range(2)]
    train, evals = ({p["id"] for p in tasks[0].splits[s]} for s in ("train", "eval"))
    assert train and evals and train.isdisjoint(evals) and len(train | evals) == 40
    assert {p["id"] for p in tasks[1].splits["eval"]} == evals


@pytest.mark.parametrize("rows,match", [
    ([ROWS[0], {"prompt": "x"}], "line 2: Object missing required field `answer`"),
    ([{"prompt": 3, "answer": "1"}], "line 1: Expected `str`, got `int` - at field `prompt`"),
    ([ROWS[0], "{not json"], "line 2: not JSON"),
    ([{"prompt": "x", "answer": "1", "level": "hard"}], "line 1: field `level` = 'hard' is not a number"),
    ([{"prompt": " ", "answer": "1"}], "line 1: field `prompt` is empty"),
])
def test_bad_rows_name_the_line_and_field(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        load_problems(_write(tmp_path / "rows.jsonl", rows))


def test_bad_files_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_problems(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="expected .jsonl or .parquet"):
        load_problems(_write(tmp_path / "rows.csv", ROWS))
    with pytest.raises(ValueError, match="has no rows"):
        load_problems(_write(tmp_path / "empty.jsonl", []))
    (tmp_path / "rows.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match="needs pyarrow: pip install pyarrow"):
        load_problems(str(tmp_path / "rows.parquet"))
    with pytest.raises(ValueError, match="task.path is empty"):
        make_task(_cfg(name="math"), text_tokenizer())


def test_parquet_rows_load_when_pyarrow_is_there(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(ROWS[:3]), tmp_path / "rows.parquet")
    assert [p["id"] for p in load_problems(str(tmp_path / "rows.parquet"))] == ["p0", "p1", "p2"]
