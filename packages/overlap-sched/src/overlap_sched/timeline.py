"""`draw`: a `Recorder` trace as a timeline PNG, laid out like DeepSeek's profile-data figures.

    recorder.save("decode.trace.json")
    draw("decode.trace.json", "decode.png", title="decode, 2 microbatches")

One row per rank and track (compute, communication), one bar per op coloured by microbatch, so
whether one microbatch's communication hides under the other's compute shows at a glance, in a
file that needs no trace viewer. It draws on a bare matplotlib `Figure` (Agg, no pyplot), so it
needs no display and leaves an interactive session's backend alone. matplotlib is imported only
when drawing: `pip install overlap-sched[plot]`.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")  # microbatch 0 blue, 1 orange
FONT_PT, DPI = 7, 100
RIGHT_IN = 0.3
LAYER = re.compile(r"L(\d+)\.(.+)")


def draw(trace, path, *, title: str | None = None, tracks=("compute", "communication")) -> Path:
    """Draw the `op` events of `trace` (a Chrome trace dict, a list of events or a JSON file's
    path) to the PNG `path`: one row per (rank, track), bars coloured by microbatch, labelled
    with the op's name without its layer prefix where they are wide enough."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.font_manager import FontProperties
        from matplotlib.patches import Patch
        from matplotlib.textpath import TextToPath
    except ImportError as error:
        raise ImportError(
            "overlap_sched.timeline.draw needs matplotlib: pip install overlap-sched[plot]"
        ) from error

    events = _op_events(trace, tracks)
    origin = min(e["ts"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - origin
    scale, unit = (1e3, "ms") if span >= 1e3 else (1.0, "µs")
    ranks = sorted({e["pid"] for e in events})
    rows = [(rank, track) for rank in ranks for track in tracks]
    by_row = defaultdict(list)
    for e in events:
        by_row[e["pid"], e["tid"]].append(e)

    names = [track if len(ranks) == 1 else f"rank {rank} {track}" for rank, track in rows]
    left = 0.3 + 0.085 * max(len(name) for name in names)  # inches: room for the row names
    busiest = max(len(row) for row in by_row.values())
    width = min(max(2 + 0.15 * busiest, 8.0), 40.0)
    height = 1.0 + 0.55 * len(rows)
    fig = Figure(figsize=(width, height), dpi=DPI)
    fig.subplots_adjust(
        left=left / width, right=1 - RIGHT_IN / width, top=1 - 0.45 / height, bottom=0.55 / height
    )
    ax = fig.add_subplot()
    px_per_us = (width - left - RIGHT_IN) * DPI / max(span, 1e-9)
    font, measure, label_px = FontProperties(size=FONT_PT), TextToPath(), {}

    for y, row in enumerate(rows):
        for e in by_row[row]:
            colour = COLOURS[e.get("args", {}).get("microbatch", 0) % len(COLOURS)]
            x = (e["ts"] - origin) / scale
            ax.barh(
                y,
                e["dur"] / scale,
                left=x,
                height=0.8,
                color=colour,
                edgecolor="white",
                linewidth=0.3,
            )
            label = _short(e["name"])
            if label not in label_px:
                points = measure.get_text_width_height_descent(label, font, ismath=False)[0]
                label_px[label] = points * DPI / 72 + 4
            if e["dur"] * px_per_us >= label_px[label]:
                ax.text(
                    x + e["dur"] / scale / 2,
                    y,
                    label,
                    ha="center",
                    va="center",
                    fontsize=FONT_PT,
                    color=_ink(colour),
                    clip_on=True,
                )

    for x in _layer_starts(events)[1:]:
        ax.axvline((x - origin) / scale, color="0.2", linewidth=0.8, linestyle=":", zorder=3)
    for y in range(len(tracks), len(rows), len(tracks)):
        ax.axhline(y - 0.5, color="0.3", linewidth=0.8)

    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(names)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span / scale)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", color="0.9", linewidth=0.5)
    ax.set_axisbelow(True)
    microbatches = sorted({e.get("args", {}).get("microbatch", 0) for e in events})
    handles = [
        Patch(color=COLOURS[m % len(COLOURS)], label=f"microbatch {m}") for m in microbatches
    ]
    ax.legend(
        handles=handles,
        loc="lower right",
        bbox_to_anchor=(1, 1),
        ncols=len(handles),
        frameon=False,
        fontsize=8,
    )
    if title:
        ax.set_title(title, loc="left", fontsize=10)
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def _op_events(trace, tracks) -> list[dict]:
    if isinstance(trace, (str, Path)):
        trace = json.loads(Path(trace).read_text())
    if isinstance(trace, dict):
        trace = trace.get("traceEvents", [])
    ops = [e for e in trace if e.get("cat") == "op" and e.get("tid") in tracks]
    if not ops:
        raise ValueError(
            f"no op events (cat 'op') on the tracks {list(tracks)} to draw: record a run with "
            "overlap_sched.Recorder and pass its trace()"
        )
    return ops


def _short(name: str) -> str:
    match = LAYER.fullmatch(name)
    return match.group(2) if match else name


def _layer_starts(events) -> list[float]:
    starts = {}
    for e in events:
        match = LAYER.fullmatch(e["name"])
        if match:
            layer = int(match.group(1))
            starts[layer] = min(starts.get(layer, e["ts"]), e["ts"])
    return [starts[layer] for layer in sorted(starts)]


def _ink(colour: str) -> str:
    r, g, b = (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"
