from core.admission import Admission


def test_capacity_follows_version_and_staleness():
    a = Admission(share=8, max_staleness=1)
    assert a.allowed(0) == 16
    a.start(16)
    assert a.allowed(0) == 0
    assert a.allowed(1) == 8


def test_sync_mode_allows_one_step_ahead_only():
    a = Admission(share=4, max_staleness=0)
    a.start(a.allowed(0))
    assert a.started == 4 and a.allowed(0) == 0 and a.allowed(1) == 4


def test_returned_groups_free_their_slot():
    a = Admission(share=4, max_staleness=0)
    a.start(4)
    a.give_back(2)
    assert a.allowed(0) == 2


def test_staleness_bound_holds_for_fifo_consumption():
    """Simulate: consumption of B groups per step in start order never exceeds max_staleness."""
    for S in (0, 1, 2, 3):
        B, a, v, starts, consumed = 8, Admission(8, S), 0, [], 0
        for _ in range(200):
            n = a.allowed(v)
            a.start(n)
            starts += [v] * n
            if len(starts) - consumed >= B:
                batch = starts[consumed:consumed + B]
                assert max(v - s for s in batch) <= S
                consumed += B
                v += 1


def test_resume_counts_in_flight():
    a = Admission.resumed(share=4, max_staleness=1, version=3, in_flight=2)
    assert a.allowed(3) == (1 + 3 + 1) * 4 - (3 * 4 + 2)
