"""The `ref-server` command line: serve, demo, bench, economics.

Building the parser imports no torch, grpc, fastapi or rich: `--help` and bad flags answer at
once. Every error is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

from ref_server import __version__, economics, kernel_choice
from ref_server.repro.published import MTP_ACCEPTANCE
from ref_server.services.config import (
    GROUP_STORES,
    KV_TRANSFERS,
    LOG_LEVELS,
    OVERLAP_STEPS,
    PRESET_NAMES,
    ROLES,
    SPECULATIVE,
    TWO_BATCH,
    WEIGHT_DTYPES,
    ServeConfig,
)

DEFAULT_PRESET = "deepseek-day6"

# The help's groups of ServeConfig fields; a field missing here lands in "other settings".
SETTING_GROUPS = {
    "what runs, and where": (
        "role", "host", "port", "http_port", "prefill_instances", "decode_instances",
    ),
    "model": (
        "preset", "model", "served_model_name", "seed", "weight_dtype", "device", "kernels",
    ),
    "engine (every instance)": (
        "num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
        "max_waiting", "hold_seconds", "kv_transfer", "two_batch", "two_batch_decode_tokens",
        "two_batch_prefill_tokens", "prefill_graph_tokens", "overlap_steps", "speculative",
        "draft_tokens",
    ),
    "router": (
        "prefill", "decode", "health_interval_s", "health_failures", "cache_threshold",
        "balance_abs_threshold", "balance_rel_threshold", "prefix_index_pages",
    ),
    "limits (the router's; max_concurrent_rpcs every server's)": (
        "max_request_bytes", "max_inflight", "tenant_share", "max_concurrent_rpcs", "max_prompts",
        "max_choices", "max_stops", "max_stop_length", "max_stop_token_ids",
        "max_request_id_length", "request_timeout_s", "queue_timeout_s",
    ),
    "expert balancing (EPLB, every instance)": (
        "redundant_experts", "eplb_interval", "eplb_layers_per_step", "expert_placement",
        "eplb_save",
    ),
    "ranks (one instance over several processes)": (
        "ranks", "rank", "group_address", "group_timeout_s", "group_store", "elastic", "join",
        "failure_timeout_s",
    ),
    "security": ("api_key_file", "isolate_cache", "tls_cert", "tls_key", "internal_secret_file"),
    "logging": ("log_level",),
}  # fmt: skip
METAVARS = {
    "host": "HOST",
    "port": "PORT",
    "http_port": "PORT",
    "model": "DIR",
    "served_model_name": "NAME",
    "device": "DEVICE",
    "max_request_bytes": "BYTES",
    "group_address": "HOST:PORT|env",
    "api_key_file": "FILE",
    "tls_cert": "FILE",
    "tls_key": "FILE",
    "internal_secret_file": "FILE",
    "expert_placement": "FILE",
    "eplb_save": "FILE",
    "kernels": "SET",
}
CHOICES = {
    "role": ROLES,
    "preset": PRESET_NAMES,
    "two_batch": TWO_BATCH,
    "overlap_steps": OVERLAP_STEPS,
    "speculative": SPECULATIVE,
    "kv_transfer": KV_TRANSFERS,
    "weight_dtype": WEIGHT_DTYPES,
    "log_level": LOG_LEVELS,
    "group_store": GROUP_STORES,
}
# `demo` always runs --role all, which sets these itself for its processes.
NOT_FOR_DEMO = ("role", "rank", "prefill", "decode", "group_address", "group_store", "join")
DEMO_DEFAULTS = {"port": "a free port", "http_port": "a free port", "log_level": "warning"}

SERVE_DESCRIPTION = """\
Run one process of the disaggregated deployment (--role router, prefill or decode), or all
of them on this machine (--role all: the instances and the router as child processes,
restarted when they die).

Settings come from the defaults shown below, then the TOML file given with --config (flat
keys, the flags' names with underscores: http_port = 8080), then the flags."""
SERVE_EPILOG = """\
examples:
  ref-server serve                                     # everything, the tiny preset
  ref-server serve --role prefill --port 6001 --model /path/to/checkpoint
  ref-server serve --role router --prefill 127.0.0.1:6001 --decode 127.0.0.1:6002 \\
                   --model /path/to/checkpoint
  torchrun --nproc-per-node 2 -m ref_server serve --role decode --port 6002 --model DIR

Instances and the router need the deployment's internal secret (REF_SERVER_INTERNAL_SECRET
or --internal-secret-file); --role all makes one and hands it to its children."""
DEMO_DESCRIPTION = """\
Start the whole deployment (--role all) on loopback and free ports, send concurrent
requests, stream the first, and report throughput and time to first token.

Settings come from the defaults shown below, then the TOML file given with --config (flat
keys, the flags' names with underscores), then the flags."""


BENCH_DESCRIPTION = """\
Send requests to a running deployment (the router's gRPC API, or with --api openai any
OpenAI-compatible HTTP server) and report throughput, time to first token (TTFT), time per
output token (TPOT), cache hits and errors.

Give one schedule; a comma-separated list runs each value in turn (a sweep):
  --rate R         steady state: Poisson arrivals of R requests/s
  --concurrency C  steady state: C requests in flight at all times
  --fill N         saturation: N requests at once; output tok/s is measured over the window in
                   which all N decode (from the last one's second token to the first one's end)"""
REPRO_DESCRIPTION = """\
Measure DeepSeek-V3- or V3.2-shaped slices on this machine's device and project them to
DeepSeek's day-6 deployment: one dense and one MoE layer as one GPU of each layout runs them
(prefill EP32: 9 expert slots, 16,384 tokens in 2 microbatches of 4K prompts; decode EP144: 2
slots, 128 requests in 2 microbatches at day 6's mean KV length of 4,989 tokens, or the lengths
given), each part of a layer timed; dispatch and combine from DeepEP's published H800 +
InfiniBand figures, scaled to the layout's bytes; balancedness from EPLB over synthetic loads.
Prints per-node tokens/s with no overlap and with ideal two-batch overlap (an upper bound), next
to DeepSeek's and SGLang's figures, and the margin at DeepSeek's prices and rent; several slices
or kernel sets side by side at each KV length. With --mtp-acceptance, decode also with MTP: the
verify step measured for V3.2 and projected for V3, the drafts projected. Every number says
whether it is measured, published, assumed or derived; a CPU run says on every line that it is
not a GPU figure."""
REPRO_EPILOG = """\
examples:
  ref-server repro                      # on a GPU: the v3 slice in FP8
  ref-server repro --zipf 0 --json      # perfectly even routing, as DeepSeek's profile data
  ref-server repro --device cpu         # the tiny slice: checks the pipeline, not a figure
  ref-server repro --kernels ours,deepseek   # ours beside FlashMLA's and DeepGEMM's kernels
  ref-server repro --slice v3,v3.2 --kv-length 4989,32768,131072 --mtp-acceptance
                                        # V3 beside V3.2 at three KV lengths, with MTP at 85 %

See docs/reproduction.md for the method and its caveats."""
BENCH_EPILOG = """\
examples:
  ref-server bench --concurrency 1,8,64 --prompt-tokens 512 --output-tokens 128
  ref-server bench --rate 2,4,8 --prompt-tokens 256..2048 --shared-prefix 0.5 --plot curve.png
  ref-server bench --fill 128 --output-tokens 256 --json > fill.json
  ref-server bench --api openai --url http://127.0.0.1:8000 --fill 64

Prompts are random token ids: the same seed sends the same prompts, so a second invocation
against the same server finds them in its prefix cache; change --seed between invocations."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; flag and help side by side when they fit."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def main(argv: list[str] | None = None) -> int:
    args, unknown = _parser().parse_known_args(argv)
    if unknown:  # the subcommand's parser says it, so the message points at its --help
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.run(args)
    except (ValueError, RuntimeError, OSError) as error:
        print(f"ref-server {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ref-server",
        description="DeepSeek-style disaggregated MoE serving.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=Parser, metavar="COMMAND"
    )

    report = commands.add_parser(
        "economics",
        help="cost, revenue and margin of a serving deployment (DeepSeek's day-6 model)",
        description="Values are layered: the preset, then the TOML file, then flags.",
        formatter_class=HelpFormatter,
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
    report.set_defaults(run=_economics, parser=report)

    serve = commands.add_parser(
        "serve",
        help="run the router, a prefill or decode instance, or all of them (--role all)",
        description=SERVE_DESCRIPTION,
        epilog=SERVE_EPILOG,
        usage="ref-server serve [--role ROLE] [--config FILE] [options]",
        formatter_class=HelpFormatter,
    )
    _serve_flags(serve, for_demo=False)
    serve.set_defaults(run=_serve, parser=serve)

    demo = commands.add_parser(
        "demo",
        help="the whole deployment on loopback, a few requests, what it measured",
        description=DEMO_DESCRIPTION,
        usage="ref-server demo [--requests N] [--max-tokens N] [--config FILE] [options]",
        formatter_class=HelpFormatter,
    )
    demo.add_argument(
        "--requests",
        type=_positive,
        default=8,
        metavar="N",
        help="concurrent requests (default: 8)",
    )
    demo.add_argument(
        "--max-tokens",
        type=_positive,
        default=24,
        metavar="N",
        help="tokens generated for each request (default: 24)",
    )
    _serve_flags(demo, for_demo=True)
    demo.set_defaults(run=_demo, parser=demo)

    bench = commands.add_parser(
        "bench",
        help="load a running deployment: throughput, TTFT, TPOT, cache hits, errors",
        description=BENCH_DESCRIPTION,
        epilog=BENCH_EPILOG,
        usage="ref-server bench (--rate R | --concurrency C | --fill N) [options]",
        formatter_class=HelpFormatter,
    )
    _bench_flags(bench)
    bench.set_defaults(run=_bench, parser=bench)

    repro = commands.add_parser(
        "repro",
        help="how much of DeepSeek's day-6 throughput and margin our parts reach (V3 slices)",
        description=REPRO_DESCRIPTION,
        epilog=REPRO_EPILOG,
        formatter_class=HelpFormatter,
    )
    _repro_flags(repro)
    repro.set_defaults(run=_repro, parser=repro)
    return parser


def _repro_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N"
    )
    parser.add_argument(
        "--slice",
        type=_slices,
        metavar="NAME[,NAME...]",
        help="v3: DeepSeek-V3's layers at its layouts (a GPU); v3.2: DeepSeek-V3.2's (V3 with "
        "the lightning indexer and sparse attention); tiny, v3.2-tiny: V3-shaped with tiny widths "
        "and fewer tokens (a CPU); several, comma-separated, side by side, the first the base "
        "(default: v3 on CUDA, tiny on the CPU)",
    )
    parser.add_argument(
        "--kv-length",
        type=_lengths,
        metavar="N[,N...]",
        help="decode's KV length a request, tokens; several, comma-separated: a table each "
        "(default: day 6's mean 4,989; the tiny slices 64)",
    )
    parser.add_argument(
        "--mtp-acceptance",
        type=_acceptance,
        nargs="?",
        const=MTP_ACCEPTANCE.value,
        metavar="P",
        help="decode also with MTP, each draft accepted at rate P (alone: DeepSeek-V3's "
        f"published 85-90 %%, its lower end {MTP_ACCEPTANCE.value:g}) (default: off)",
    )
    parser.add_argument(
        "--mtp-drafts",
        type=int,
        choices=(1, 2, 3),
        default=1,
        metavar="K",
        help="MTP's drafts a round, 1 to 3 (default: 1, as DeepSeek-V3's one module)",
    )
    parser.add_argument(
        "--weight-dtype",
        choices=("bf16", "fp8"),
        help="the slices' weights (default: fp8 on CUDA, as DeepSeek serves V3; on the CPU "
        "dense float32)",
    )
    parser.add_argument(
        "--reps", type=_positive, default=5, metavar="N", help="timed steps a phase (default: 5)"
    )
    parser.add_argument(
        "--zipf",
        type=float,
        default=1.0,
        metavar="S",
        help="expert popularity for EPLB's balancedness, Zipf(S) over the experts; 0: perfectly "
        "even routing, as DeepSeek's profile data (default: 1.0)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights, tokens, loads (default: 0)")
    parser.add_argument(
        "--kernels",
        default="ours",
        metavar="SET[,SET...]",
        help="the slices' kernels: ours, deepseek (FlashMLA, DeepGEMM where they have a part) or "
        "deepseek:PART[,PART...]; several, comma-separated, are measured in turn and set side "
        "by side, the first the base (default: ours)",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="print JSON instead of the table; with PATH write it there and print the table",
    )
    parser.add_argument(
        "--terms", action="store_true", help="also every input term, with its source and note"
    )
    parser.add_argument(
        "--plot",
        metavar="PNG",
        help="bars of ours beside the published figures (one slice, kernel set, KV length)",
    )


def _bench_flags(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("where")
    target.add_argument(
        "--api", choices=("grpc", "openai"), default="grpc", help="which API (default: grpc)"
    )
    target.add_argument(
        "--address",
        metavar="HOST:PORT",
        default="127.0.0.1:50051",
        help="the router's gRPC address (default: 127.0.0.1:50051)",
    )
    target.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the OpenAI API's base URL, without /v1 (default: http://127.0.0.1:8000)",
    )
    target.add_argument(
        "--api-key-file", metavar="FILE", help="a file whose first line is the API key"
    )
    target.add_argument(
        "--tls-ca", metavar="FILE", help="PEM file of the server certificate's CA (TLS)"
    )
    schedule = parser.add_argument_group("schedule (one of)").add_mutually_exclusive_group(
        required=True
    )
    schedule.add_argument("--rate", type=_sweep, metavar="R[,R...]", help="requests per second")
    schedule.add_argument(
        "--concurrency", type=_sweep, metavar="C[,C...]", help="requests in flight"
    )
    schedule.add_argument("--fill", type=_sweep, metavar="N[,N...]", help="requests at once")
    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--requests",
        type=_positive,
        metavar="N",
        help="requests per run, not with --fill (default: 64, or the length file's lines)",
    )
    workload.add_argument(
        "--prompt-tokens",
        metavar="N|LO..HI",
        help="prompt length: fixed, or uniform in LO..HI (default: 128)",
    )
    workload.add_argument(
        "--output-tokens",
        metavar="N|LO..HI",
        help="max_tokens of each request: fixed, or uniform in LO..HI (default: 32)",
    )
    workload.add_argument(
        "--lengths",
        metavar="FILE",
        help='JSONL of {"prompt_tokens": n, "output_tokens": m} lines, used in order '
        "(instead of the two above)",
    )
    workload.add_argument(
        "--shared-prefix",
        type=float,
        default=0.0,
        metavar="RATIO",
        help="share of each prompt that is one prefix common to all, 0..1 (default: 0)",
    )
    workload.add_argument(
        "--seed", type=int, default=0, help="lengths, tokens, arrivals, sampling (default: 0)"
    )
    workload.add_argument(
        "--temperature", type=float, default=0.0, metavar="X", help="0: greedy (default: 0)"
    )
    workload.add_argument(
        "--vocab-size",
        type=_positive,
        metavar="N",
        help="prompt token ids are drawn below N (default: the model's; needed with --api openai)",
    )
    workload.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="one request's limit, start to end (default: 600)",
    )
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print JSON instead of a table")
    output.add_argument(
        "--plot", metavar="PATH", help="write latency against throughput as a PNG (matplotlib)"
    )


def _serve_flags(parser: argparse.ArgumentParser, for_demo: bool) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file of the settings below")
    fields = {f.name: f for f in dataclasses.fields(ServeConfig)}
    if for_demo:
        fields = {name: f for name, f in fields.items() if name not in NOT_FOR_DEMO}
    grouped = {name for names in SETTING_GROUPS.values() for name in names}
    groups = {**SETTING_GROUPS, "other settings": [n for n in fields if n not in grouped]}
    defaults = ServeConfig()
    for title, names in groups.items():
        names = [name for name in names if name in fields]
        if not names:
            continue
        group = parser.add_argument_group(title)
        for name in names:
            field = fields[name]
            shown = _shown(getattr(defaults, name))
            if for_demo:
                shown = DEMO_DEFAULTS.get(name, shown)
            help = f"{field.metadata['help']} (default: {shown})".replace("%", "%%")
            flag = "--" + name.replace("_", "-")
            if field.type == "bool":
                group.add_argument(
                    flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help
                )
                continue
            group.add_argument(
                flag,
                dest=name,
                type={"int": int, "float": float, "list[str]": _addresses}.get(field.type, str),
                choices=CHOICES.get(name),
                metavar=None if name in CHOICES else _metavar(name, field.type),
                help=help,
            )


def _metavar(name: str, annotation: str) -> str:
    if name in METAVARS:
        return METAVARS[name]
    if annotation == "float":
        return "SECONDS" if name.endswith(("_s", "seconds")) else "X"
    return {"int": "N", "list[str]": "HOST:PORT,..."}.get(annotation, "TEXT")


def _shown(default) -> str:
    if default in (None, "", []):
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, list):
        return ",".join(default)
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number > 0, got {text!r}")
    return value


def _slices(text: str) -> list[str]:
    from ref_server.repro.run import LAYOUTS

    names = text.split(",")
    for name in names:
        if name not in LAYOUTS:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {name!r} (choose from {', '.join(LAYOUTS)})"
            )
    return names


def _lengths(text: str) -> list[int]:
    try:
        return [_positive(value) for value in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers > 0 separated by commas, got {text!r}"
        ) from None


def _acceptance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a rate from 0 to 1, got {text!r}")
    return value


def _sweep(text: str) -> list[float]:
    try:
        return [float(value) for value in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None


def _addresses(text: str) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()]


def _serve_config(args: argparse.Namespace, **forced) -> ServeConfig:
    """The defaults, then the TOML file, then the flags; an error the file's values cause
    names the file."""
    names = [f.name for f in dataclasses.fields(ServeConfig)]
    flags = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None} | forced
    config = ServeConfig.from_file(args.config, **flags) if args.config else ServeConfig(**flags)
    if config.role in ("prefill", "decode"):
        from ref_server.services.deployment import torchrun_values

        config = config.replace(**torchrun_values(dict(os.environ), config.port))
    if config.role == "all":  # before starting processes that would each fail to import them
        kernel_choice.check_findable(config.kernel_parts(), config.kernels)
    return config


def _serve(args: argparse.Namespace) -> int:
    config = _serve_config(args)
    if config.role != "all":
        from ref_server.services.servers import serve

        serve(config)
        return 0
    from ref_server.services.deployment import Deployment, free_port, stop_on_signals

    if config.port == 0:  # the supervisor must know the router's port to wait for it
        config = config.replace(port=free_port())
    _interrupt_on_signals()  # while starting: the Deployment stops what it started
    running = Deployment(config)
    try:
        stop = stop_on_signals()
        http = f", HTTP on {config.host}:{config.http_port}" if config.http_port else ""
        print(f"ref-server: serving on {config.host}:{config.port}{http}", flush=True)
        while not stop.wait(0.5):
            if running.failure:
                raise RuntimeError(running.failure)
    finally:
        running.stop()
    return 0


def _interrupt_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt (exit code 130)."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)


def _demo(args: argparse.Namespace) -> int:
    config = _serve_config(args, role="all")  # bad settings: an answer before torch loads
    from rich.console import Console

    from ref_server.services.demo import run_demo
    from ref_server.services.deployment import free_port
    from ref_server.services.servers import torch_device

    torch_device(config)  # before run_demo announces a deployment that cannot start
    _interrupt_on_signals()  # run_demo stops its deployment on the way out
    if args.port is None:
        config = config.replace(port=free_port())
    if args.http_port is None:
        config = config.replace(http_port=free_port())
    if args.log_level is None:  # the instances' INFO lines would land inside the streamed text
        config = config.replace(log_level="warning")
    run_demo(config, args.requests, args.max_tokens, Console(soft_wrap=True))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from ref_server.bench.report import Mode
    from ref_server.bench.workload import LengthSpec, Workload, read_length_file

    kind = next(kind for kind in ("rate", "concurrency", "fill") if getattr(args, kind))
    modes = [Mode(kind, value) for value in getattr(args, kind)]
    if args.lengths and (args.prompt_tokens or args.output_tokens):
        raise ValueError("--lengths gives the lengths: leave out --prompt-tokens, --output-tokens")
    specs = {}
    for name in ("prompt_tokens", "output_tokens"):
        try:
            if getattr(args, name):
                specs[name] = LengthSpec.parse(getattr(args, name))
        except ValueError as error:
            raise ValueError(f"--{name.replace('_', '-')}: {error}") from None
    length_file = read_length_file(args.lengths) if args.lengths else None
    workload = Workload(
        **specs, length_file=length_file, shared_prefix=args.shared_prefix, seed=args.seed
    )
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.plot:
        from ref_server.bench.plot import require_matplotlib

        require_matplotlib()  # before the runs, not after them
    api_key = _api_key(args.api_key_file) if args.api_key_file else None
    from rich.console import Console

    from ref_server.bench.runner import run_bench
    from ref_server.bench.targets import GrpcTarget, OpenAITarget, RequestOptions

    options = RequestOptions(args.temperature, args.timeout)
    if args.api == "grpc":
        target = GrpcTarget(args.address, options, api_key, args.tls_ca)
    else:
        target = OpenAITarget(args.url, options, api_key, args.tls_ca)
    _interrupt_on_signals()
    document = run_bench(
        target, workload, modes, args.requests, args.vocab_size, Console(stderr=True)
    )
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        from ref_server.bench.table import print_report

        print_report(document, Console())
    if args.plot:
        from ref_server.bench.plot import draw

        draw(document, args.plot)
    return 0


def _repro(args: argparse.Namespace) -> int:
    choices = kernel_choice.parse_list(args.kernels)
    kernels = [choice.spec for choice in choices]
    device = args.device
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch has no CUDA device")
    on_gpu = device != "cpu"
    slice_names = args.slice or ["v3" if on_gpu else "tiny"]
    if args.plot:
        if len(kernels) * len(slice_names) * len(args.kv_length or [None]) > 1:
            raise ValueError(
                "--plot draws one kernel set, one slice and one KV length; give each once"
            )
        from ref_server.bench.plot import require_matplotlib

        require_matplotlib()  # before the measurement, not after it
    from ref_server.repro.report import tables
    from ref_server.repro.run import draw, reproduce

    weight_dtype = args.weight_dtype or ("fp8" if on_gpu else "bf16")
    for choice in choices:  # a missing library before the first set's measurement
        parts = choice.parts_in(fp8=weight_dtype == "fp8", expert_parallel=False)
        kernel_choice.check_findable(parts, choice.spec)
    runs = [
        run
        for slice_name in slice_names
        for spec in kernels
        for run in reproduce(
            slice_name,
            device,
            None if weight_dtype == "bf16" else weight_dtype,
            args.reps,
            args.zipf,
            args.seed,
            spec,
            args.kv_length,
            args.mtp_acceptance,
            args.mtp_drafts,
        )
    ]
    reports = tables(runs)
    if args.json:
        documents = [report.to_json() for report in reports]
        document = documents[0] if len(documents) == 1 else {"tables": documents}
        text = json.dumps(document, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    if args.json != "-":
        print("\n\n".join(report.to_text(every_term=args.terms) for report in reports))
    if args.plot:
        draw(reports[0], args.plot)
    return 0


def _api_key(path: str) -> str:
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"API key file not found: {path}") from None
    if not lines or not lines[0].strip():
        raise ValueError(f"API key file {path} has no key on its first line")
    return lines[0].strip()


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
