#!/usr/bin/env python
"""Where one rank's iterations go, per schedule, from its ``DCREDIT_TIMELINE`` trace.

    python scripts/timeline_stats.py /tmp/tl/trace.rank0.json

An iteration starts at the trace's first forward event and at each forward event after a
backward one.  Iterations are grouped by
the schedule that ran them: the plan installed last (``plan k``: the k-th plan of the trace,
whichever optimizer installed it), or the candidate of the race's last ``race: switch`` (or
``race: winner``) mark.  Per group, medians over its iterations (wall ms):

* ``iter``: start to the next start;  ``fwd`` / ``bwd``: first to last event of each pass;
* ``wait``: the forward's waits for an owed update (phase 2 reaching a parameter first);
* ``busy``: the union of the blocks' INFLIGHT spans (some collective on the wire);
* ``idle``: the iteration less ``busy``; ``idle in bwd``: the part of it inside backward;
* ``tail``: from the end of backward to the last collective's end in the iteration;
* ``queued``: the median block's time from ready to released (the window's hold).

A gap in ``busy`` while blocks are queued is the window holding work back; a gap with nothing
queued is the model not having produced the gradient yet.  Needs only the standard library.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plot_timeline import load_trace, tracks  # noqa: E402


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _clip(spans, lo, hi):
    return [(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]


def iterations(events: list[dict]) -> list[dict]:
    """One record per iteration: its bounds, its schedule's label and what happened in it."""
    names, _ = tracks(events)
    passes, inflight, queued, labels = [], [], [], []
    plans = 0
    for e in events:
        ph, ts = e.get("ph"), float(e.get("ts", 0.0))
        if ph == "X":
            kind = names.get(e["pid"], "")
            span = (ts, ts + float(e.get("dur", 0.0)))
            if kind in ("forward", "backward"):
                passes.append((span[0], span[1], kind, str(e.get("name", ""))))
            elif e.get("cat") == "INFLIGHT":
                inflight.append(span)
            elif e.get("cat") == "QUEUED":
                queued.append(span)
        elif ph == "i" and e.get("cat") == "mark":
            name, args = str(e.get("name", "")), e.get("args", {})
            if name in ("race: switch", "race: winner"):
                labels.append((ts, str(args.get("candidate", "?"))))
            elif name == "plan installed":
                plans += 1
                labels.append((ts, f"plan {plans}"))
    passes.sort()
    starts, previous = [], None
    for s, _, kind, _ in passes:
        if kind == "forward" and previous in (None, "backward"):
            starts.append(s)
        previous = kind
    labels.sort()
    out = []
    for lo, hi in zip(starts, starts[1:]):
        inside = [p for p in passes if lo <= p[0] < hi]
        fwd = [p for p in inside if p[2] == "forward"]
        bwd = [p for p in inside if p[2] == "backward"]
        if not fwd or not bwd:
            continue
        label = next((name for t, name in reversed(labels) if t <= lo), "-")
        b0, b1 = min(p[0] for p in bwd), max(p[1] for p in bwd)
        wire = _clip(inflight, lo, hi)
        ends = [e for _, e in wire]
        out.append({
            "label": label, "iter": hi - lo,
            "fwd": max(p[1] for p in fwd) - lo, "bwd": b1 - b0,
            "wait": sum(p[1] - p[0] for p in fwd if p[3].startswith("wait for update")),
            "busy": _union(wire), "idle in bwd": (b1 - b0) - _union(_clip(wire, b0, b1)),
            "tail": max(0.0, max(ends, default=b1) - b1),
            "queued": statistics.median([e - s for s, e in _clip(queued, lo, hi)] or [0.0]),
        })
        out[-1]["idle"] = out[-1]["iter"] - out[-1]["busy"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--skip", type=int, default=1,
                   help="iterations dropped after each change of schedule (default 1)")
    args = p.parse_args()
    groups: dict[str, list[dict]] = defaultdict(list)
    previous, run = None, 0
    for it in iterations(load_trace(args.trace)):
        run = run + 1 if it["label"] == previous else 1
        previous = it["label"]
        if run > args.skip:
            groups[it["label"]].append(it)
    keys = ("iter", "fwd", "bwd", "wait", "busy", "idle", "idle in bwd", "tail", "queued")
    print("| schedule | n | " + " | ".join(keys) + " |")
    print("|---|---:|" + "---:|" * len(keys))
    for label, its in groups.items():
        cells = [f"{statistics.median(it[k] for it in its) / 1e3:.1f}" for k in keys]
        print(f"| {label} | {len(its)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
