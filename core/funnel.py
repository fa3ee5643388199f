"""The discard funnel: where every generated group went, from the roles' ``funnel/*`` metrics (each role counts its
part: ARCHITECTURE.md, Metric vocabulary). Pure: no I/O. When the books close,
``generated = trained + lost + resident + in_flight`` (``balance()`` is the difference; tests/unit/test_funnel.py
walks through an example). A counter that goes down belongs to a restarted role and is added to what it had counted;
the gauges (``GAUGES``) are taken as last reported, ``trained`` included: a learner resumes it from its checkpoint,
so groups trained after that checkpoint and lost in a crash count once, when trained again."""

from __future__ import annotations

import math

PREFIX = "funnel/"
LEN_PREFIX = "funnel/len/"
LEN_BUCKETS = (64, 256, 1024, 4096)  # tokens of a group's longest completion
BUCKETS = tuple(f"<={b}" for b in LEN_BUCKETS) + (f">{LEN_BUCKETS[-1]}",)
# every reason a group is not trained, in the order the funnel line shows them
REASONS = ("no_signal", "stale_at_admission", "stale_in_buffer", "stale_at_learner", "invalid", "too_large",
           "rolled_back", "skipped", "restart")
GAUGES = ("in_flight", "resident", "trained")
_LABELS = {"skipped": "skipped by guard", "restart": "too stale to resume"}  # else the reason, spaced


def length_bucket(n_tokens: int) -> str:
    return next((f"<={b}" for b in LEN_BUCKETS if n_tokens <= b), BUCKETS[-1])


def lost_metrics(reasons: dict, by_len: dict) -> dict[str, float]:
    """A role's ``funnel/<reason>`` and ``funnel/len/<bucket>`` counters (cumulative, this incarnation)."""
    return {**{PREFIX + r: float(n) for r, n in reasons.items()},
            **{LEN_PREFIX + b: float(n) for b, n in by_len.items()}}


class Funnel:
    def __init__(self):
        self._last: dict[tuple[str, str], float] = {}  # (source, key) -> last value reported
        self._base: dict[tuple[str, str], float] = {}  # what earlier incarnations of the source counted

    def update(self, source: str, values: dict) -> None:
        """A record's values from ``source`` (``role/id``); keys outside ``funnel/`` are ignored."""
        for key, v in values.items():
            if not key.startswith(PREFIX) or not isinstance(v, float) or not math.isfinite(v):
                continue
            sk = (source, key)
            last = self._last.get(sk, 0.0)
            if v < last and key[len(PREFIX):] not in GAUGES:  # a restarted role counts from 0 again
                self._base[sk] = self._base.get(sk, 0.0) + last
            self._last[sk] = v

    def total(self, name: str) -> float:
        key = PREFIX + name
        return sum(v + self._base.get(sk, 0.0) for sk, v in self._last.items() if sk[1] == key)

    def lost(self) -> dict[str, float]:
        return {r: n for r in REASONS if (n := self.total(r))}

    def balance(self) -> float:
        """generated - (trained + lost + resident + in flight): 0 when every role's last counts are in."""
        return self.total("generated") - self.total("trained") - sum(self.lost().values()) \
            - self.total("resident") - self.total("in_flight")

    def line(self) -> str | None:
        """``generated 480 → accepted 440 → trained 400 · lost 56 (no signal 30, ...) · held 24``; None before
        any count. Mid-run each role's part is its last report (the buffer's: at most a second old)."""
        if not any(k[1].startswith(PREFIX) for k in self._last):
            return None
        lost, held = self.lost(), self.total("resident") + self.total("in_flight")
        out = " → ".join(f"{name} {self.total(name):.0f}" for name in ("generated", "accepted", "trained"))
        if lost:
            out += f" · lost {sum(lost.values()):.0f} (" + ", ".join(
                f"{_LABELS.get(r, r.replace('_', ' '))} {n:.0f}" for r, n in lost.items()) + ")"
        return out + f" · held {held:.0f}"

    def length_line(self) -> str | None:
        """``lost by response length: <=64 40, <=256 16``; None with nothing lost."""
        by_len = [f"{b} {n:.0f}" for b in BUCKETS if (n := self.total("len/" + b))]
        return "lost by response length: " + ", ".join(by_len) if by_len else None


def from_records(records) -> Funnel:
    f = Funnel()
    for rec in records:
        f.update(f"{rec.role}/{rec.id}", rec.values)
    return f
