"""The benchmark document as a table for people: one column per run, headed by its label
(saturation or steady state), one row per figure; then a line on each fill run's window."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _number(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:,.1f}"


def print_report(document: dict, console: Console) -> None:
    """One column per run, one row per figure; a line per fill run on its window."""
    workload, runs = document["workload"], document["runs"]
    lengths = (
        f"lengths from {workload['length_file']}"
        if "length_file" in workload
        else f"prompts of {workload['prompt_tokens']} tokens, {workload['output_tokens']} out"
    )
    table = Table(
        title=f"ref-server bench: {document['model']['name']} over {document['api']} at "
        f"{document['target']}",
        caption=f"{lengths}, shared prefix {workload['shared_prefix']:.0%}, "
        f"seed {workload['seed']}",
    )
    table.add_column("")
    for run in runs:
        table.add_column(run["label"], justify="right")
    rows = {
        "requests ok / sent": [f"{r['requests']['ok']} / {r['requests']['sent']}" for r in runs],
        "errors": [
            ", ".join(f"{name} {n}" for name, n in r["requests"]["errors"].items()) or "none"
            for r in runs
        ],
        "duration s": [_number(r["duration_s"]) for r in runs],
        "input tok/s": [_number(r["throughput"]["input_tok_s"]) for r in runs],
        "output tok/s": [_number(r["throughput"]["output_tok_s"]) for r in runs],
    }
    if any(r["mode"] == "fill" for r in runs):
        rows["output tok/s, full batch"] = [
            _number(r["window"]["output_tok_s"]) if r.get("window") else "-" for r in runs
        ]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        for statistic in ("mean", "p50", "p90", "p99"):
            rows[f"{name} {statistic} ms"] = [_number(r[key][statistic], 1000) for r in runs]
    rows["cache-hit share"] = [
        "-" if r["cache_hit_share"] is None else f"{r['cache_hit_share']:.1%}" for r in runs
    ]
    for name, values in rows.items():
        table.add_row(name, *values)
    console.print(table)
    for run in runs:
        for status, message in run["requests"]["error_examples"].items():
            console.print(f"{run['label']}: {status}: {message}", highlight=False, markup=False)
        if run["mode"] == "fill":
            console.print(_window_note(run), highlight=False)


def _window_note(run: dict) -> str:
    size, window = int(run["value"]), run["window"]
    if window is None:
        return f"fill {size}: no saturation figure: {run['window_problem']}"
    return (
        f"fill {size}: all {size} requests decoding from {window['start_s']:.3f} s to "
        f"{window['end_s']:.3f} s ({window['seconds']:.3f} s, {window['output_tokens']} output "
        f"tokens): {window['output_tok_s']:,.1f} output tok/s at saturation"
    )
