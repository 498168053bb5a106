"""The `ref-server` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from rich.console import Console
from rich.table import Table

from ref_server import __version__, economics

DEFAULT_PRESET = "deepseek-day6"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except economics.EconomicsError as error:
        print(f"ref-server {args.command}: error: {error}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ref-server", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    report = commands.add_parser(
        "economics",
        help="cost, revenue and margin of a serving deployment (DeepSeek's day-6 model)",
        description="Values are layered: the preset, then the TOML file, then flags.",
    )
    report.add_argument(
        "--preset",
        help=f"base values; known: {', '.join(sorted(economics.PRESETS))} "
        f"(default: the config file's `preset`, else {DEFAULT_PRESET})",
    )
    report.add_argument("--config", metavar="FILE", help="TOML file of values (see docs)")
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")
    for field in dataclasses.fields(economics.CostInputs):
        report.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=int if field.type == "int" else float,
            help=field.metadata["help"],
        )
    report.set_defaults(run=_economics)
    return parser


def _economics(args: argparse.Namespace) -> int:
    from_file = economics.read_toml(args.config) if args.config else {}
    file_preset = from_file.pop("preset", None)
    preset_name = args.preset or file_preset or DEFAULT_PRESET
    from_flags = {name: getattr(args, name) for name in economics.CostInputs.field_names()}
    inputs = economics.build_inputs(preset_name, from_file, from_flags)
    report = economics.evaluate(inputs)
    if args.json:
        document = {
            "preset": preset_name,
            "inputs": dataclasses.asdict(inputs),
            "report": dataclasses.asdict(report),
        }
        print(json.dumps(document, indent=2))
    else:
        Console().print(_table(preset_name, inputs, report))
    return 0


def _table(preset_name: str, inputs: economics.CostInputs, report: economics.CostReport) -> Table:
    hours = f"{inputs.window_hours:g} h"
    table = Table(title=f"Serving economics (base preset: {preset_name})", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        (f"GPU cost over {hours}", f"${report.cost_usd:,.0f}"),
        ("  if provisioned at peak nodes", f"${report.peak_provisioned_cost_usd:,.0f}"),
        (f"theoretical revenue over {hours}", f"${report.revenue_usd:,.0f}"),
        ("cost-profit margin", f"{report.margin:.0%}"),
        ("cache-hit share of input", f"{report.cache_hit_share:.2%}"),
        ("prefill cost per M input tokens", f"${report.prefill_usd_per_m_input:.4f}"),
        ("decode cost per M output tokens", f"${report.decode_usd_per_m_output:.4f}"),
        ("prefill nodes needed", f"{report.prefill_nodes_needed:,.1f}"),
        ("decode nodes needed", f"{report.decode_nodes_needed:,.1f}"),
        (
            "nodes needed / mean nodes",
            f"{report.nodes_needed:,.1f} / {inputs.mean_nodes:,.2f} "
            f"({report.busy_share_of_mean_nodes:.1%})",
        ),
    ]
    for label, value in rows:
        table.add_row(label, value)
    return table
