"""``python run.py tail [RUN_DIR]``: what makes a run's ratio tail (``run_dir/tail.jsonl``, the last line of a
step winning): which tokens, how stale (a stale tail shrinks with ``buffer.max_staleness``; a staleness-0 one
is engine/learner numerics), where in the response ("first 10%": positions < ceil(length / 10), "last 10%" as
many from the end, else "middle"), which texts recur, whether it grows. Rich tables on a terminal, else text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter, defaultdict

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from core.files import run_file
from core.metrics import bounded_json, regular
from core.monitor import fmt
from learner.tail import TAIL_FILE

TOP = 20  # most extreme tokens shown per direction
BUCKETS = ("first 10%", "middle", "last 10%")


def load(run_dir: str, last: int = 0) -> list[dict]:
    """The run's step lines by step, the last per step winning (the ``last`` ones if > 0), a torn end skipped."""
    path = run_file(run_dir, TAIL_FILE, "the learner writes it every step when learner.tail_k > 0 "
                    "(no step finished yet, or tail_k = 0)")
    if not regular(path):
        raise ValueError(f"{path} is not a regular file (a directory or FIFO, say): not read")
    with open(path, "rb") as f:  # bounded_json: no line past MAX_LINE bytes or MAX_DEPTH deep is parsed
        lines = [line for line in f if line.strip()]
    by_step = {}
    for n, line in enumerate(lines, 1):
        try:
            rec = bounded_json(line)
        except ValueError as e:
            if n < len(lines):
                raise ValueError(f"{path}:{n} is not a JSON line: {e}") from None
            continue
        if not (isinstance(rec, dict) and isinstance(rec.get("step"), int) and isinstance(rec.get("records"), list)):
            raise ValueError(f"{path}:{n} is not a tail line (needs an int `step` and a `records` list): "
                             f"{line[:80]!r}")
        by_step[rec["step"]] = rec
    steps = [by_step[s] for s in sorted(by_step)]
    return steps[-last:] if last > 0 else steps


def bucket(position: int, length: int) -> str:
    n = math.ceil(length / 10)
    return BUCKETS[0] if position < n else BUCKETS[2] if position >= length - n else BUCKETS[1]


def _shares(counter: Counter, total: int, order) -> dict:
    """``{key: {count, share}}`` in ``order``; share None when there is nothing (JSON has no NaN)."""
    return {str(key): {"count": counter[key], "share": counter[key] / total if total else None} for key in order}


def top_tokens(recs: list[dict], n: int = 10) -> list[dict]:
    """The ``n`` token ids most often in the tail: text, count, per direction, mean log-ratio."""
    groups = defaultdict(list)
    for r in recs:
        groups[r["token_id"]].append(r)
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:n]
    return [{"token_id": tid, "text": rs[0]["text"], "count": len(rs),
             "high": sum(r["direction"] == "high" for r in rs), "low": sum(r["direction"] == "low" for r in rs),
             "mean_log_ratio": sum(r["log_ratio"] for r in rs) / len(rs)} for tid, rs in ranked]


def trend(steps: list[dict], n: int = 8) -> list[dict]:
    """Per bucket of consecutive steps: the largest "high" and smallest "low" ratio, the mean |log-ratio|."""
    out, size = [], max(1, math.ceil(len(steps) / n))
    for chunk in (steps[i:i + size] for i in range(0, len(steps), size)):
        recs = [r for s in chunk for r in s["records"]]
        high = [r["ratio"] for r in recs if r["direction"] == "high"]
        low = [r["ratio"] for r in recs if r["direction"] == "low"]
        mean = sum(abs(r["log_ratio"]) for r in recs) / len(recs) if recs else None
        out.append({"first_step": chunk[0]["step"], "last_step": chunk[-1]["step"], "records": len(recs),
                    "max_ratio": max(high, default=None), "min_ratio": min(low, default=None),
                    "mean_abs_log_ratio": mean})
    return out


def summarise(steps: list[dict], top: int = TOP) -> dict:
    recs = [r for s in steps for r in s["records"]]
    high = sorted((r for r in recs if r["direction"] == "high"), key=lambda r: -r["log_ratio"])
    low = sorted((r for r in recs if r["direction"] == "low"), key=lambda r: r["log_ratio"])
    lags = Counter(r["staleness"] for r in recs)
    dirs = Counter((r["staleness"], r["direction"]) for r in recs)  # {lag: {count, share, high, low}}
    by_staleness = {key: {**v, "high": dirs[int(key), "high"], "low": dirs[int(key), "low"]}
                    for key, v in _shares(lags, len(recs), sorted(lags)).items()}
    by_position = _shares(Counter(bucket(r["position"], r["length"]) for r in recs), len(recs), BUCKETS)
    return {"steps": len(steps), "first_step": steps[0]["step"] if steps else None,
            "last_step": steps[-1]["step"] if steps else None, "records": len(recs),
            "tokens": sum(s.get("tokens", 0) for s in steps), "high": high[:top], "low": low[:top],
            "by_staleness": by_staleness, "by_position": by_position,
            "top_tokens": top_tokens(recs), "trend": trend(steps)}


EXTREME_HEADERS = ("ratio", "log ρ", "token", "pos/len", "stale", "logp", "behaviour", "group", "sample", "step")


def _extreme_row(r: dict) -> tuple:
    return (fmt(r["ratio"]), fmt(r["log_ratio"]), repr(r["text"]), f"{r['position']}/{r['length']}",
            str(r["staleness"]), fmt(r["logp"]), fmt(r["behaviour_logp"]), r["group"], str(r["sample"]),
            str(r["step"]))


def _share_rows(table: dict) -> list[tuple]:
    return [(key, str(v["count"]), f"{100 * v['share']:.1f}%" if v["count"] else "–") for key, v in table.items()]


def sections(s: dict) -> list[tuple[str, tuple, list[tuple]]]:
    """``(title, headers, rows)`` of every table, strings only: one layout for both renderers."""
    return [
        (f"highest ratio (top {len(s['high'])})", EXTREME_HEADERS, [_extreme_row(r) for r in s["high"]]),
        (f"lowest ratio (top {len(s['low'])})", EXTREME_HEADERS, [_extreme_row(r) for r in s["low"]]),
        ("tail by staleness", ("staleness", "count", "share"), _share_rows(s["by_staleness"])),
        ("tail by response position", ("position", "count", "share"), _share_rows(s["by_position"])),
        ("most frequent tail tokens", ("token", "id", "count", "high", "low", "mean log ρ"),
         [(repr(t["text"]), str(t["token_id"]), str(t["count"]), str(t["high"]), str(t["low"]),
           fmt(t["mean_log_ratio"])) for t in s["top_tokens"]]),
        ("tail by step", ("steps", "records", "max ratio", "min ratio", "mean |log ρ|"),
         [(f"{b['first_step']}-{b['last_step']}", str(b["records"]), fmt(b["max_ratio"]),
           fmt(b["min_ratio"]), fmt(b["mean_abs_log_ratio"])) for b in s["trend"]]),
    ]


def headline(s: dict) -> str:
    return (f"{s['records']} tail tokens from {s['steps']} steps ({s['first_step']}..{s['last_step']}), "
            f"{s['tokens']} response tokens in all")


def plain(s: dict) -> str:
    """Aligned plain text (pipes, logs)."""
    out = [headline(s)]
    for title, headers, rows in sections(s):
        widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
        out += ["", title] + ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
                              for row in (headers, *rows)]
    return "\n".join(out)


def show_rich(s: dict) -> None:
    console = Console()
    console.print(headline(s))
    for title, headers, rows in sections(s):
        table = Table(*headers, title=title, box=box.SIMPLE, title_justify="left")
        for row in rows:
            table.add_row(*map(Text, row))  # Text, not markup: a token may be "[/b]"
        console.print(table)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="run.py tail", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="?", default=os.path.join("runs", "latest"))
    ap.add_argument("--last", type=int, default=0, help="only the last N steps (0 = all)")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    args = ap.parse_args(argv)
    if args.last < 0:
        ap.error(f"--last must be >= 0, got {args.last}")
    try:
        s = summarise(load(args.run_dir, args.last))
    except (FileNotFoundError, ValueError) as e:
        print(f"tail: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(s, ensure_ascii=False))
    elif sys.stdout.isatty():
        show_rich(s)
    else:
        print(plain(s))
    return 0
