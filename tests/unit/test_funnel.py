"""The discard funnel (core/funnel.py): a worked example of the books, restarts, and the lines shown."""

import math

from core import funnel
from core.messages import MetricRecords


def _rec(role, id, **values):
    return MetricRecords(role=role, id=id, step=0, time=0.0, values={f"funnel/{k}": float(v) for k, v in values.items()})


def test_the_books_of_a_small_run_close_reason_by_reason():
    # two actors generate 60 groups: 10 left out (equal rewards), 2 still unacknowledged; the buffer
    # accepts 45 of the 48 it was sent, rejects 3 as stale, drops 4 stale ones later and holds 6; the
    # learner was served 35: 32 trained, 2 stale at the learner, 1 in a batch a guard skipped
    recs = [_rec("actor", "actor0", generated=40, no_signal=6, in_flight=2),
            _rec("actor", "actor1", generated=20, no_signal=4, in_flight=0),
            _rec("buffer", "buffer", accepted=45, stale_at_admission=3, stale_in_buffer=4, resident=6),
            _rec("learner", "learner", trained=32, stale_at_learner=2, skipped=1)]
    books = funnel.from_records(recs)
    assert books.total("generated") == 60 and books.total("in_flight") == 2
    assert books.lost() == {"no_signal": 10, "stale_at_admission": 3, "stale_in_buffer": 4, "stale_at_learner": 2,
                            "skipped": 1}
    assert books.balance() == 0  # 60 = 32 trained + 20 lost + 6 resident + 2 in flight
    line = books.line()
    assert line.startswith("generated 60 → accepted 45 → trained 32 · lost 20 (no signal 10, stale at admission 3")
    assert line.endswith("skipped by guard 1) · held 8")
    # one more group trained, without the buffer's report of it leaving: the books are one off, visibly
    books.update("learner/learner", {"funnel/trained": 33.0})
    assert books.balance() == -1


def test_a_restarted_role_adds_to_what_it_had_counted_but_gauges_are_taken_as_last_reported():
    books = funnel.Funnel()
    books.update("actor/actor0", {"funnel/generated": 30.0, "funnel/no_signal": 5.0, "funnel/in_flight": 4.0})
    books.update("actor/actor0", {"funnel/generated": 7.0, "funnel/no_signal": 1.0, "funnel/in_flight": 1.0})
    assert (books.total("generated"), books.total("no_signal"), books.total("in_flight")) == (37, 6, 1)
    # a learner resumed from its checkpoint reports fewer trained groups: a gauge, not a restart's count
    books.update("learner/learner", {"funnel/trained": 40.0})
    books.update("learner/learner", {"funnel/trained": 32.0})
    assert books.total("trained") == 32
    # non-finite values and keys outside funnel/ are ignored
    books.update("learner/learner", {"funnel/trained": math.nan, "learner/loss": 1.0})
    assert books.total("trained") == 32


def test_lines_before_any_count_and_by_length():
    books = funnel.Funnel()
    assert books.line() is None and books.length_line() is None
    books.update("buffer/buffer", {"funnel/len/<=64": 3.0, "funnel/len/>4096": 1.0, "funnel/stale_in_buffer": 4.0})
    assert books.length_line() == "lost by response length: <=64 3, >4096 1"
    assert [funnel.length_bucket(n) for n in (0, 64, 65, 4096, 4097)] == ["<=64", "<=64", "<=256", "<=4096", ">4096"]
