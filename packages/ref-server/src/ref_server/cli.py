"""The `ref-server` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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
    except (economics.EconomicsError, ValueError, RuntimeError, OSError) as error:
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

    serve = commands.add_parser(
        "serve",
        help="run the router, a prefill or decode instance, or all three (--role all)",
        description="Values: ServeConfig's defaults, then the TOML file, then flags.",
    )
    _serve_flags(serve)
    serve.set_defaults(run=_serve)

    demo = commands.add_parser(
        "demo",
        help="the whole deployment on loopback: a few requests, throughput and economics",
    )
    _serve_flags(demo)
    demo.add_argument("--requests", type=int, default=8, help="concurrent requests to send")
    demo.add_argument("--max-tokens", type=int, default=24)
    demo.set_defaults(run=_demo)
    return parser


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    from ref_server.services.deployment import ServeConfig

    parser.add_argument("--config", metavar="FILE", help="TOML file of ServeConfig values")
    for f in dataclasses.fields(ServeConfig):
        kind = {"int": int, "float": float}.get(str(f.type), str)
        extra = {"choices": ["router", "prefill", "decode", "all"]} if f.name == "role" else {}
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, **extra)


def _serve_config(args: argparse.Namespace):
    from ref_server.services.deployment import ServeConfig, read_config_file, torchrun_values

    values = read_config_file(args.config) if args.config else {}
    for f in dataclasses.fields(ServeConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            values[f.name] = value.split(",") if f.name in ("prefill", "decode") else value
    if values.get("role") in ("prefill", "decode"):
        port = values.get("port", ServeConfig.port)
        values |= torchrun_values(dict(os.environ), port)
    return ServeConfig(**values)


def _serve(args: argparse.Namespace) -> int:
    from ref_server.services import deployment

    config = _serve_config(args)
    stop = deployment.stop_on_signals()
    if config.role == "all":
        running = deployment.Deployment(config)
        print(f"ref-server: serving on {running.address} (metrics on :{config.metrics_port})")
        stop.wait()
        running.stop()
    elif config.role == "router":
        server, router, _ = deployment.start_router(config)
        print(f"ref-server router: serving on {config.host}:{config.port}", flush=True)
        stop.wait()
        router.stop.set()
        server.stop(grace=2).wait()
    else:
        server, loop = deployment.start_instance(config)
        print(f"ref-server {config.role}: serving on {config.host}:{config.port}", flush=True)
        stop.wait()
        server.stop(grace=2).wait()
        loop.stop()
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ref_server.services.demo import run_demo

    config = _serve_config(args)
    if args.port is None:
        from ref_server.services.deployment import free_port

        config = dataclasses.replace(config, port=free_port(), metrics_port=free_port())
    measured = run_demo(config, args.requests, args.max_tokens, Console())
    inputs = economics.build_inputs(DEFAULT_PRESET, measured)
    title = f"{DEFAULT_PRESET} with the throughput measured here"
    Console().print(_table(title, inputs, economics.evaluate(inputs)))
    return 0


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
