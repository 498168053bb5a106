"""Latency against throughput, one point per run of a sweep, as a PNG.

Two panels, time to first token and time per output token (p50 and p99, ms) against output
tok/s (over the full-batch window for fill runs, the whole run otherwise), one line per kind of
run (rate, concurrency, fill), each point marked with its rate, concurrency or fill size. Drawn
on a bare matplotlib `Figure` (Agg, no pyplot), so it needs no display; matplotlib is optional
(`pip install ref-server[plot]`), checked by `require_matplotlib` before a benchmark starts.
"""

from __future__ import annotations

from pathlib import Path

from ref_server.bench.report import headline_output_tok_s

MISSING = "--plot needs matplotlib: pip install matplotlib (or ref-server[plot])"
KINDS = {"rate": "rate (steady state)", "concurrency": "concurrency (steady state)",
         "fill": "fill (saturation)"}  # fmt: skip
PANELS = (("ttft_s", "time to first token"), ("tpot_s", "time per output token"))


def require_matplotlib() -> None:
    """RuntimeError with the install line when matplotlib is missing."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise RuntimeError(MISSING) from None


def draw(document: dict, path: str | Path) -> Path:
    """Write the runs of a benchmark document to the PNG `path`; RuntimeError when no run has
    an output throughput (failed runs, fill runs without a full-batch window)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    runs = [run for run in document["runs"] if headline_output_tok_s(run)]
    if not runs:
        raise RuntimeError(f"nothing to plot in {path}: no run has an output throughput")
    figure = Figure(figsize=(11, 4.2), dpi=100, layout="constrained")
    figure.suptitle(
        f"ref-server bench: {document['model']['name']} over {document['api']}", fontsize=10
    )
    for axes, (key, title) in zip(figure.subplots(1, 2), PANELS, strict=True):
        for kind in KINDS:
            same = sorted((r for r in runs if r["mode"] == kind), key=headline_output_tok_s)
            if not same:
                continue
            x = [headline_output_tok_s(r) for r in same]
            for quantile, style in (("p50", "o-"), ("p99", "s--")):
                y = [_ms(r[key][quantile]) for r in same]
                axes.plot(x, y, style, label=f"{KINDS[kind]} {quantile}")
            for run, at in zip(same, x, strict=True):
                if run[key]["p50"] is not None:
                    axes.annotate(
                        f"{run['value']:g}",
                        (at, _ms(run[key]["p50"])),
                        textcoords="offset points",
                        xytext=(4, 4),
                        fontsize=7,
                    )
        axes.set_title(title, fontsize=10)
        axes.set_xlabel("output tok/s (fill: over the full-batch window)")
        axes.set_ylabel("ms")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    path = Path(path)
    figure.savefig(path)
    return path


def _ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else 1000 * seconds
