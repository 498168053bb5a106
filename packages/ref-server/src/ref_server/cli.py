"""The `ref-server` command line: serve, demo, economics.

Building the parser imports no torch: `--help` and bad flags answer at once, and errors are
one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from ref_server import __version__, economics
from ref_server.services.config import ROLES, ServeConfig

DEFAULT_PRESET = "deepseek-day6"


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError, OSError) as error:
        print(f"ref-server {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ref-server", description="DeepSeek-style disaggregated MoE serving.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

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
        help="run the router, a prefill or decode instance, or all of them (--role all)",
        description="Settings: the defaults below, then the TOML file (--config), then flags.",
        usage="ref-server serve [--role ROLE] [--config FILE] [options]",
    )
    _serve_flags(serve)
    serve.set_defaults(run=_serve)

    demo = commands.add_parser(
        "demo",
        help="the whole deployment on loopback, a few requests, what it measured",
        description="Starts --role all on free ports, sends concurrent requests, reports.",
        usage="ref-server demo [--requests N] [--max-tokens N] [options]",
    )
    demo.add_argument("--requests", type=int, default=8, help="concurrent requests (default: 8)")
    demo.add_argument("--max-tokens", type=int, default=24, help="tokens each (default: 24)")
    _serve_flags(demo)
    demo.set_defaults(run=_demo)
    return parser


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file of the settings below")
    settings = parser.add_argument_group("settings (also TOML keys, with underscores)")
    defaults = ServeConfig()
    for f in dataclasses.fields(ServeConfig):
        default = getattr(defaults, f.name)
        shown = ",".join(default) if isinstance(default, list) else default
        help = f"{f.metadata['help']} (default: {'none' if shown in (None, '') else shown})"
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            settings.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help
            )
            continue
        kind = {"int": int, "float": float, "list[str]": _addresses}.get(f.type, str)
        metavar = {"int": "N", "float": "X", "list[str]": "HOST:PORT,..."}.get(f.type, "TEXT")
        choices = ROLES if f.name == "role" else None
        settings.add_argument(
            flag, dest=f.name, type=kind, help=help, metavar=None if choices else metavar,
            choices=choices,
        )  # fmt: skip


def _addresses(text: str) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()]


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    from ref_server.services.deployment import torchrun_values

    flags = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ServeConfig)
        if getattr(args, f.name, None) is not None
    }
    config = ServeConfig.from_file(args.config, **flags) if args.config else ServeConfig(**flags)
    if config.role in ("prefill", "decode"):
        config = config.replace(**torchrun_values(dict(os.environ), config.port))
    return config


def _serve(args: argparse.Namespace) -> int:
    config = _serve_config(args)
    if config.role != "all":
        from ref_server.services.servers import serve

        serve(config)
        return 0
    from ref_server.services.deployment import Deployment, stop_on_signals

    stop = stop_on_signals()
    running = Deployment(config)
    http = f", HTTP on {config.host}:{config.http_port}" if config.http_port else ""
    print(f"ref-server: serving on {config.host}:{config.port}{http}", flush=True)
    try:
        stop.wait()
    finally:
        running.stop()
    return 0


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ref_server.services.demo import run_demo
    from ref_server.services.deployment import free_port

    config = _serve_config(args)
    if args.port is None:
        config = config.replace(port=free_port())
    if args.http_port is None:
        config = config.replace(http_port=free_port())
    run_demo(config, args.requests, args.max_tokens, Console())
    return 0


def _economics(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

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
        return 0
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
    Console().print(table)
    return 0
