"""Pure logic of the buffer: dedup memory, admission, accounting, staleness policies."""

import doctest
import random

import pytest

from buffer import policies
from buffer.store import Entry, SeenKeys, Store, entry_from_group
from core.funnel import length_bucket
from tests.support.synth import make_group


def entry(actor="a", seq=0, version=0, nbytes=100, length=10):
    return Entry((actor, seq), version, nbytes, length)


# ---- SeenKeys ---------------------------------------------------------------------------------


def test_seen_keys_matches_a_plain_set_under_random_inserts():
    rng = random.Random(0)
    seen, ref = SeenKeys(), set()
    for _ in range(3000):
        key = (rng.choice("abc"), rng.randrange(400))
        assert (key in seen) == (key in ref)
        seen.add(key)
        ref.add(key)
    for a in "abc":
        for s in range(450):
            assert ((a, s) in seen) == ((a, s) in ref)


def test_seen_keys_is_compact_for_in_order_actors():
    seen = SeenKeys()
    for s in range(10000):
        seen.add(("a", s))
    seen.add(("a", 10005))  # an actor restart that skipped a reserved block
    assert seen._hwm == {"a": 10005} and seen._gaps == {"a": [(10000, 10004)]}
    assert ("a", 10002) not in seen and ("a", 9999) in seen and ("b", 0) not in seen
    assert seen.next_seq("a") == 10006 and seen.next_seq("zz") == 0


def test_seen_keys_huge_seq_jump_costs_one_interval():
    seen = SeenKeys()
    seen.add(("a", 2**40))
    assert ("a", 2**40) in seen and ("a", 5) not in seen
    assert len(seen._gaps["a"]) == 1


# ---- admission and accounting --------------------------------------------------------------


def test_offer_is_idempotent_even_after_consumption_and_drop():
    st = Store(capacity_groups=10, capacity_bytes=10**6, max_staleness=1, policy="oldest_first")
    assert st.offer(entry(seq=0)) == ("ok", "")
    assert st.offer(entry(seq=0)) == ("duplicate", "")
    st.offer(entry(seq=1, version=0))
    taken, _ = st.take(1, learner_version=0)
    st.consume([taken[0].key])
    assert st.offer(entry(seq=0)) == ("duplicate", "")  # consumed keys stay remembered
    _, dropped = st.take(5, learner_version=9)  # seq 1 is now stale: dropped
    assert [e.key for e in dropped] == [("a", 1)]
    assert st.offer(entry(seq=1)) == ("duplicate", "")  # and so do dropped ones
    c = st.counters
    assert (c.accepted, c.consumed, c.dropped["stale"], c.duplicates) == (2, 1, 1, 3)
    assert len(st.resident) == 0 and st.invariant_ok()


def test_capacity_in_groups_and_bytes_answers_busy_never_evicts():
    st = Store(capacity_groups=3, capacity_bytes=250)
    assert [st.offer(entry(seq=i, nbytes=100))[0] for i in range(3)] == ["ok", "ok", "busy"]  # bytes
    st2 = Store(capacity_groups=2, capacity_bytes=10**6)
    assert [st2.offer(entry(seq=i))[0] for i in range(3)] == ["ok", "ok", "busy"]  # groups
    assert st2.saturated and set(st2.resident) == {("a", 0), ("a", 1)}
    assert st2.offer(entry(seq=2)) == ("busy", "")  # a refused key is not remembered as seen
    st2.take(1, 0)
    st2.consume([("a", 0)])
    assert not st2.saturated and st2.offer(entry(seq=2)) == ("ok", "")
    assert st2.counters.busy == 2 and st2.invariant_ok()


def test_group_larger_than_the_whole_buffer_is_rejected_not_busy_forever():
    st = Store(capacity_groups=3, capacity_bytes=50)
    assert st.offer(entry(nbytes=51)) == ("rejected", "too_large")


def test_stale_on_arrival_is_rejected_and_bucketed_by_length():
    st = Store(capacity_groups=10, capacity_bytes=10**6, max_staleness=2)
    assert st.offer(entry(seq=0, version=1, length=3000), learner_version=4) == ("rejected", "stale")
    assert st.offer(entry(seq=1, version=2), learner_version=4) == ("ok", "")
    assert ("a", 0) not in st.seen  # never accepted, so not a duplicate if it comes back
    s = st.stats()
    assert s["buffer/dropped_stale"] == 1 and s["funnel/len/<=4096"] == 1
    assert s["buffer/accepted"] == 1 and s["buffer/invariant_ok"] == 1.0


def test_invariant_detects_broken_accounting():
    st = Store(capacity_groups=10, capacity_bytes=10**6)
    st.offer(entry(seq=0))
    assert st.invariant_ok()
    st.counters.consumed += 1  # simulate a bookkeeping bug
    assert not st.invariant_ok() and st.stats()["buffer/invariant_ok"] == 0.0


def test_leases_are_not_served_twice_and_release_returns_them():
    st = Store(capacity_groups=10, capacity_bytes=10**6)
    for i in range(4):
        st.offer(entry(seq=i))
    a, _ = st.take(3, 0, lessee="L1")
    b, _ = st.take(3, 0, lessee="L2")
    assert [e.key[1] for e in a] == [0, 1, 2] and [e.key[1] for e in b] == [3]
    assert st.available() == 0 and st.take(1, 0)[0] == []
    assert st.release("L1") == 3 and st.available() == 3
    again, _ = st.take(10, 0)
    assert sorted(e.key[1] for e in again) == [0, 1, 2]


def test_consume_for_a_lessee_retires_only_what_it_holds():
    """A learner can only have trained on groups leased to it: the rest of its Consumed (keys
    never served, or served to an earlier learner) is counted and ignored."""
    st = Store(capacity_groups=10, capacity_bytes=10**6)
    for i in range(4):
        st.offer(entry(seq=i))
    st.take(2, 0, lessee="L1")  # seqs 0, 1
    st.take(1, 0, lessee="L2")  # seq 2; seq 3 stays unleased
    done = st.consume([("a", i) for i in range(5)], lessee="L1")
    assert [e.key for e in done] == [("a", 0), ("a", 1)]
    c = st.counters
    assert (c.consumed, c.consumed_not_leased, c.consumed_unknown) == (2, 2, 1)
    assert sorted(st.resident) == [("a", 2), ("a", 3)] and st.invariant_ok()
    assert st.stats()["buffer/consumed_ignored"] == 3


def test_take_at_least_leases_nothing_when_too_few_fresh_groups():
    st = Store(capacity_groups=10, capacity_bytes=10**6, max_staleness=0)
    st.offer(entry(seq=0, version=3))
    st.offer(entry(seq=1, version=2))
    taken, drops = st.take(2, learner_version=3, at_least=2)
    assert taken == [] and [e.key for e in drops] == [("a", 1)]  # stale ones still go
    assert st.leased == 0 and list(st.resident) == [("a", 0)]


def test_entry_from_group_uses_oldest_token_version_and_longest_completion():
    g = make_group("a", 7, completions=3, tokens=50, version=4)
    e = entry_from_group(g, raw=b"x" * 123)
    assert e.key == ("a", 7) and e.min_version == g.min_version() == 4
    assert e.length == 50 and e.nbytes == 123


def test_length_buckets():
    assert [length_bucket(n) for n in (1, 64, 65, 1024, 5000)] == ["<=64", "<=64", "<=256", "<=1024", ">4096"]


# ---- policies: a worked example (learner at v5, max_staleness 2: B and D are stale) ------------


def _example():
    # arrival order A..E, oldest token versions 3 1 4 2 4
    return [Entry((name, 0), v, 1, 1, order=i) for i, (name, v) in enumerate(zip("ABCDE", (3, 1, 4, 2, 4)))]


def test_drop_stale_worked_example():
    take, drops = policies.drop_stale(_example(), learner_version=5, max_staleness=2, n=2)
    assert [e.key[0] for e in take] == ["A", "C"]
    assert [e.key[0] for e in drops] == ["B", "D"]
    full, _ = policies.drop_stale(_example(), 5, 2)
    assert [e.key[0] for e in full] == ["A", "C", "E"]


def test_oldest_first_worked_example_is_lazy():
    take, drops = policies.oldest_first(_example(), learner_version=5, max_staleness=2, n=2)
    assert [e.key[0] for e in take] == ["A", "C"]
    assert [e.key[0] for e in drops] == ["B"]  # D not looked at yet


@pytest.mark.parametrize("name", sorted(policies.POLICIES))
def test_no_policy_ever_serves_a_group_beyond_the_bound(name):
    rng = random.Random(1)
    st = Store(capacity_groups=10**6, capacity_bytes=10**9, max_staleness=2, policy=name)
    v = 0
    for i in range(2000):
        st.offer(entry(seq=i, version=max(0, v - rng.randrange(5))))
        if rng.random() < 0.3:
            v += rng.randrange(2)
            taken, _ = st.take(rng.randrange(1, 6), v)
            assert all(v - e.min_version <= 2 for e in taken)
            st.consume([e.key for e in taken])
    assert st.invariant_ok()
    c = st.counters
    assert c.consumed > 0 and c.dropped["stale"] > 0


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown buffer policy"):
        Store(1, 1, policy="lifo")


def test_stale_wait_holds_for_groups_in_generation_until_they_are_in_or_waited_for_too_long():
    assert doctest.testmod(policies).failed == 0  # the worked example in StaleWait's docstring
    w = policies.StaleWait(wait_s=10)
    w.report("a0", 3)
    w.report("a1", 5)
    assert w.holds(7, 4, now=0.0) and w.holds(7, 4, now=1.0) and w.held == 1  # one request, counted once
    w.report("a0", 3)  # a repeated report keeps its clock
    assert not w.holds(8, 4, now=10.5) and w.timeouts == 1  # a0 waited for too long: forgotten
    assert w.holds(9, 5, now=11.0)  # a1's groups are now at risk
    w.report("a1", -1)  # in: nothing to wait for
    assert not w.holds(10, 5, now=11.0) and w.held == 2
