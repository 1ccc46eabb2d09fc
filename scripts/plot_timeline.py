#!/usr/bin/env python
"""Draw one rank's dcredit_hvd timeline (``DCREDIT_TIMELINE``) as a PNG Gantt chart.

    python scripts/plot_timeline.py /tmp/trace.rank0.json --out chart.png --start-ms 200 --end-ms 260

Rows, top to bottom: forward, backward, gate (window releases as ticks, marks in red), then one
row per gradient tensor in priority order (index 0 first) with each block's QUEUED and INFLIGHT
spans in different colours.  The x axis is milliseconds since the timeline was created.  A file
whose job died before ``close()`` (no closing ``]``) is read the way Perfetto reads it.

Needs only matplotlib, so a trace copied off the cluster can be plotted anywhere.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

FIXED_ROWS = ("forward", "backward", "gate")
COLOURS = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "QUEUED": "#c9c9c9",
    "INFLIGHT": "tab:green",
    "release": "black",
    "mark": "tab:red",
}


def load_trace(path: str) -> list[dict]:
    """The events of a Chrome trace file, tolerating a missing final ``]`` and a trailing comma.
    An array that still does not parse (a job killed in mid-write, a file two writers shared)
    is read one event per line, as the timeline writes it; the lines that do not parse are
    skipped and counted on stderr."""
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if text.startswith("{"):  # the object form: {"traceEvents": [...]}
        return list(json.loads(text).get("traceEvents", []))
    if not text.endswith("]"):
        text = text.rstrip().rstrip(",") + "]"
    elif text[:-1].rstrip().endswith(","):
        text = text[:-1].rstrip().rstrip(",") + "]"
    try:
        return list(json.loads(text))
    except json.JSONDecodeError:
        return _events_by_line(path, text)


def _events_by_line(path: str, text: str) -> list[dict]:
    events, bad = [], 0
    for line in text.splitlines():
        line = line.strip().lstrip("[").rstrip("]").strip().rstrip(",")
        if not line:
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            bad += 1
    print(f"({bad} line(s) of {path} did not parse and were skipped)", file=sys.stderr)
    return events


def tracks(events: list[dict]) -> tuple[dict[int, str], dict[int, int]]:
    """``pid -> name`` and ``pid -> sort index`` from the metadata events."""
    names: dict[int, str] = {}
    order: dict[int, int] = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            names[e["pid"]] = str(e.get("args", {}).get("name", e["pid"]))
        elif e.get("name") == "process_sort_index":
            order[e["pid"]] = int(e.get("args", {}).get("sort_index", e["pid"]))
    return names, order


def row_order(names: dict[int, str], order: dict[int, int], pids: set[int]) -> list[int]:
    """Forward, backward, gate first, then every other track by sort index (tensor priority)."""
    fixed = {name: pid for pid, name in names.items() if name in FIXED_ROWS}
    rows = [fixed[n] for n in FIXED_ROWS if n in fixed]
    rest = sorted((p for p in set(names) | pids if p not in rows), key=lambda p: (order.get(p, p), p))
    return rows + rest


def plot(events: list[dict], out: str, start_ms: float | None = None, end_ms: float | None = None,
         title: str | None = None, dpi: int = 110) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    names, order = tracks(events)
    timed = [e for e in events if e.get("ph") in ("X", "i", "I") and "ts" in e]
    lo = -math.inf if start_ms is None else start_ms
    hi = math.inf if end_ms is None else end_ms

    def visible(a: float, b: float) -> bool:
        return b >= lo and a <= hi

    spans: dict[tuple[int, str], list[tuple[float, float, int]]] = defaultdict(list)
    instants: dict[tuple[int, str], list[float]] = defaultdict(list)
    lanes: dict[int, int] = defaultdict(lambda: 1)
    xs: list[float] = []
    for e in timed:
        pid = e.get("pid", 0)
        t0 = e["ts"] / 1000.0
        if e["ph"] == "X":
            t1 = t0 + e.get("dur", 0) / 1000.0
            if not visible(t0, t1):
                continue
            cat = e.get("cat") or names.get(pid, "")
            tid = int(e.get("tid", 0))
            lanes[pid] = max(lanes[pid], tid + 1)
            spans[(pid, cat)].append((t0, t1 - t0, tid))
            xs += [t0, t1]
        else:
            if not visible(t0, t0):
                continue
            kind = "release" if e.get("cat") == "release" or e.get("name") == "release" else "mark"
            instants[(pid, kind)].append(t0)
            xs.append(t0)

    pids = {p for p, _ in spans} | {p for p, _ in instants}
    rows = [p for p in row_order(names, order, pids) if p in pids or names.get(p) in FIXED_ROWS]
    n = max(1, len(rows))
    y_of = {pid: n - 1 - i for i, pid in enumerate(rows)}  # first row at the top

    height = min(60.0, max(3.0, 1.4 + 0.11 * n))
    fig, ax = plt.subplots(figsize=(14, height))
    for (pid, cat), items in spans.items():
        if pid not in y_of:
            continue
        k = lanes[pid]
        h = 0.8 / k
        colour = COLOURS.get(cat, "tab:purple")
        by_lane: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for t0, w, tid in items:
            by_lane[tid].append((t0, max(w, 1e-6)))
        for tid, bars in by_lane.items():
            y0 = y_of[pid] - 0.4 + (k - 1 - tid) * h
            ax.broken_barh(bars, (y0, h), facecolors=colour, edgecolors="none", linewidth=0)
    for (pid, kind), ts in instants.items():
        if pid not in y_of:
            continue
        y = y_of[pid]
        ax.vlines(ts, y - 0.45, y + 0.45, colors=COLOURS[kind], linewidth=0.6)

    every = max(1, math.ceil(n / 50))  # label every k-th tensor row; the fixed rows always
    ticks, labels = [], []
    k_th = 0
    for pid in rows:
        name = names.get(pid, str(pid))
        if name not in FIXED_ROWS:
            k_th += 1
            if (k_th - 1) % every:
                continue
        ticks.append(y_of[pid])
        labels.append(name)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7 if n > 30 else 9)
    ax.set_ylim(-0.6, n - 0.4)
    if xs:
        left = max(lo, min(xs)) if start_ms is None else start_ms
        right = min(hi, max(xs)) if end_ms is None else end_ms
        if right <= left:
            right = left + 1.0
        ax.set_xlim(left, right)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    ax.set_title(title or "dcredit_hvd timeline", loc="left", fontsize=10)
    handles = [Patch(color=COLOURS[k], label=k) for k in ("forward", "backward", "QUEUED", "INFLIGHT")]
    handles += [Line2D([], [], color=COLOURS["release"], label="window release"),
                Line2D([], [], color=COLOURS["mark"], label="mark")]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=6,
              frameon=False, borderaxespad=0.2)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="one rank's trace file (DCREDIT_TIMELINE output)")
    p.add_argument("--out", help="PNG to write (default: the trace's name with .png)")
    p.add_argument("--start-ms", type=float, default=None, help="left edge of the window (ms)")
    p.add_argument("--end-ms", type=float, default=None, help="right edge of the window (ms)")
    p.add_argument("--dpi", type=int, default=110)
    args = p.parse_args(argv)
    out = args.out or os.path.splitext(args.trace)[0] + ".png"
    events = load_trace(args.trace)
    plot(events, out, args.start_ms, args.end_ms, title=os.path.basename(args.trace), dpi=args.dpi)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
