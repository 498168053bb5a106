"""Starting the pieces: an instance (prefill or decode), the router, or all three at once.

`ServeConfig` holds every setting (TOML file, then flags). `--role all` starts a prefill and a
decode instance as child processes, waits until their health services say SERVING, then runs
the router in this process; stopping it (Ctrl-C, SIGTERM) stops the children too.

An instance of several ranks (`ranks`) is that many processes, one gRPC server each, joined by
a gloo group: attention is data-parallel (the router balances over the ranks as over
instances) and the MoE layers expert-parallel through ep_comm.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import grpc
import torch
import torch.distributed as dist

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import ref_server.model as M
from ref_server.engine import Engine, SchedulerConfig
from ref_server.model.checkpoint import read_config
from ref_server.services.engine_loop import EngineLoop
from ref_server.services.instance import DecodeService, PrefillService
from ref_server.services.metrics import Metrics
from ref_server.services.router import ModelFacts, RouterService
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

ROLES = ("router", "prefill", "decode", "all")
MAX_MESSAGE_BYTES = 64 << 20


@dataclass
class ServeConfig:
    role: str = "all"
    host: str = "127.0.0.1"
    port: int = 50051  # the router's (or this instance's) gRPC port
    metrics_port: int = 9464  # the router's Prometheus endpoint
    preset: str = "tiny"  # random weights of a preset, unless `model` names a checkpoint
    model: str | None = None
    seed: int = 0
    device: str = "auto"  # cuda when available
    num_blocks: int = 512
    block_size: int = 64
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    max_waiting: int = 1024
    hold_seconds: float = 60.0  # how long a prefill instance keeps KV nobody pulls
    max_request_bytes: int = 1 << 20  # larger Generate requests are INVALID_ARGUMENT
    prefill_instances: int = 1  # started by --role all
    decode_instances: int = 1
    prefill: list[str] = field(default_factory=list)  # the router's instances
    decode: list[str] = field(default_factory=list)
    ranks: int = 1  # processes per instance: data-parallel attention, expert-parallel MoE
    rank: int = 0  # this process's rank in its instance (--role all sets it)
    group_address: str | None = None  # host:port where the ranks meet; "env": torchrun's
    group_timeout_s: float = 300.0  # how long a rank waits for its peers before failing

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.ranks < 1 or not 0 <= self.rank < self.ranks:
            raise ValueError(f"need 0 <= rank < ranks, got rank {self.rank} of {self.ranks}")
        if self.ranks > 1 and self.role in ("prefill", "decode") and not self.group_address:
            raise ValueError("an instance of several ranks needs group_address (host:port)")

    @property
    def torch_device(self) -> torch.device:
        """cuda when available for "auto"; a GPU without an index is the rank's own."""
        name = self.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(name)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", self.rank % torch.cuda.device_count())
        return device

    def join_group(self) -> dist.ProcessGroup | None:
        """This instance's gloo group, once every rank has joined; None for one rank."""
        if self.ranks == 1:
            return None
        address = self.group_address
        dist.init_process_group(
            "gloo",
            init_method="env://" if address == "env" else f"tcp://{address}",
            rank=self.rank,
            world_size=self.ranks,
            timeout=timedelta(seconds=self.group_timeout_s),
        )
        return dist.group.WORLD

    def scheduler(self) -> SchedulerConfig:
        """The engine's settings, which ServeConfig holds under the same names."""
        names = [f.name for f in dataclasses.fields(SchedulerConfig)]
        return SchedulerConfig(**{name: getattr(self, name) for name in names})

    def load_model(self, group: dist.ProcessGroup | None = None) -> M.Model:
        device = self.torch_device
        dtype = torch.float32
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dtype = torch.bfloat16
        if self.model:
            return M.from_pretrained(self.model, dtype=dtype, device=device, group=group)
        return M.from_preset(self.preset, seed=self.seed, dtype=dtype, device=device, group=group)

    def model_args(self) -> M.ModelArgs:
        if self.model:
            return read_config(Path(self.model))
        if self.preset not in M.PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; presets: {', '.join(M.PRESETS)}")
        return M.PRESETS[self.preset]


def torchrun_values(environ: dict[str, str], port: int) -> dict:
    """Under torchrun, a worker is one rank of an instance: its rank and group come from the
    environment, and it serves on `port` + its local rank."""
    if int(environ.get("WORLD_SIZE", "1")) == 1:
        return {}
    return dict(
        ranks=int(environ["WORLD_SIZE"]),
        rank=int(environ["RANK"]),
        group_address="env",
        port=port + int(environ.get("LOCAL_RANK", environ["RANK"])),
    )


def read_config_file(path: str | Path) -> dict:
    """ServeConfig values from a TOML file (flat keys, the field names)."""
    path = Path(path)
    try:
        values = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    known = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"{path}: unknown keys {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return values


def stop_on_signals() -> threading.Event:
    """An event set by SIGINT or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _server(config: ServeConfig, services: list[str]) -> tuple[grpc.Server, health.HealthServicer]:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_num_seqs + 16),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    health_service = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    names = [pb.DESCRIPTOR.services_by_name[s].full_name for s in services]
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    address = f"{config.host}:{config.port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address}")
    return server, health_service


def start_instance(config: ServeConfig) -> tuple[grpc.Server, EngineLoop]:
    """A prefill or decode instance (one rank of it), SERVING once its model is loaded, and
    NOT_SERVING for good if its ranks lose each other."""
    group = config.join_group()
    engine = Engine(config.load_model(group), config.scheduler())
    services = ["Prefill", "KvTransfer"] if config.role == "prefill" else ["Decode"]
    server, health_service = _server(config, services)
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    loop = EngineLoop(
        engine, config.hold_seconds, group, on_failure=lambda: health_service.set("", not_serving)
    )
    if config.role == "prefill":
        service = PrefillService(loop, config.max_model_len)
        rpc.add_PrefillServicer_to_server(service, server)
        rpc.add_KvTransferServicer_to_server(service, server)
    else:
        rpc.add_DecodeServicer_to_server(DecodeService(loop, config.max_model_len), server)
    server.start()
    health_service.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, loop


def model_facts(config: ServeConfig) -> tuple[ModelFacts, object]:
    args = config.model_args()
    tokenizer = M.load_tokenizer(args, config.model)
    page_bytes = args.num_hidden_layers * config.block_size * args.cache_width * 2
    facts = ModelFacts(
        name=config.model or config.preset,
        vocab_size=args.vocab_size,
        max_model_len=config.max_model_len,
        num_layers=args.num_hidden_layers,
        num_parameters=args.num_parameters(),
        eos_token_ids=[] if args.eos_token_id is None else [args.eos_token_id],
        page_size=config.block_size,
        page_bytes=page_bytes,
    )
    return facts, tokenizer


def start_router(config: ServeConfig, metrics: Metrics | None = None):
    """The router over config.prefill / config.decode; returns (server, service, health)."""
    facts, tokenizer = model_facts(config)
    metrics = metrics or Metrics()
    service = RouterService(
        config.prefill, config.decode, facts, tokenizer, metrics, config.max_request_bytes
    )
    server, health_service = _server(config, ["Router"])
    rpc.add_RouterServicer_to_server(service, server)
    if config.metrics_port:
        metrics.serve(config.metrics_port)
    server.start()
    health_service.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, service, health_service


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Until the health service at `address` says SERVING; RuntimeError after `timeout` or if
    `process` exits first."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"the process for {address} exited with {process.returncode}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"{address} was not SERVING within {timeout:g} s")


def instance_command(
    config: ServeConfig,
    role: str,
    port: int,
    rank: int = 0,
    group_address: str | None = None,
    device: str | None = None,
) -> list[str]:
    """The command line that starts one rank of an instance with this config's model and
    engine (on `device` if given, else the config's)."""
    launch = dict(role=role, port=port, rank=rank, group_address=group_address)
    if device is not None:
        launch["device"] = device
    command = [sys.executable, "-m", "ref_server", "serve"]
    for f in dataclasses.fields(ServeConfig):
        skip = ("metrics_port", "prefill", "decode", "host")
        if f.name in skip or f.name.endswith("_instances"):
            continue
        value = launch[f.name] if f.name in launch else getattr(config, f.name)
        if value is not None:
            command += ["--" + f.name.replace("_", "-"), str(value)]
    return command


class Deployment:
    """Prefill and decode instances as child processes, and the router in this process. On
    GPUs (device auto or cuda), the n-th rank started, counting over instances, runs on GPU
    n mod the GPU count: on 8 GPUs a prefill and a decode instance of 4 ranks each take
    GPUs 0-3 and 4-7; on one GPU they all share it."""

    def __init__(self, config: ServeConfig, startup_timeout: float = 600.0) -> None:
        self.config = config
        self.children: dict[str, subprocess.Popen] = {}  # by address
        roles = ["prefill"] * config.prefill_instances + ["decode"] * config.decode_instances
        addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
        gpus = torch.cuda.device_count() if config.device in ("auto", "cuda") else 0
        try:
            for role in roles:
                group_address = f"127.0.0.1:{free_port()}" if config.ranks > 1 else None
                for rank in range(config.ranks):  # the router balances over every rank
                    port = free_port()
                    address = f"127.0.0.1:{port}"
                    device = f"cuda:{len(self.children) % gpus}" if gpus else None
                    command = instance_command(config, role, port, rank, group_address, device)
                    self.children[address] = subprocess.Popen(command)
                    addresses[role].append(address)
            for address, child in self.children.items():
                wait_serving(address, startup_timeout, child)
            router = dataclasses.replace(config, role="router", **addresses)
            self.server, self.router, self.health = start_router(router)
        except BaseException:
            self.stop()
            raise
        self.address = f"{config.host}:{config.port}"

    def stop(self) -> None:
        if getattr(self, "server", None) is not None:
            self.health.enter_graceful_shutdown()
            self.router.stop.set()
            self.server.stop(grace=2).wait()
        for child in self.children.values():
            if child.poll() is None:
                child.terminate()
        for child in self.children.values():
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
