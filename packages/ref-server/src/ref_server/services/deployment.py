"""`--role all`: every process of a deployment on this machine, supervised.

`Deployment(config)` starts the prefill and decode instances (each of `ranks` processes),
waits until they are SERVING, then starts the router process and waits until it is SERVING
(it is once it has registered a prefill and a decode instance). All of them get the
deployment's internal secret through their environment (one is generated unless
`internal_secret_file` or REF_SERVER_INTERNAL_SECRET gives it). A supervisor thread restarts
a process that dies (all ranks of its instance together, with a growing delay); while an
instance is down the router routes around it, and says NOT_SERVING if it was the last of its
role. An elastic instance (`--elastic`) goes on over the ranks it has left: the supervisor
restarts a lost rank alone, with its command plus `--join` (same address, so the router takes it
back once it serves), after the same growing delays counted for that rank, and leaves the
instance short of it after as many failures in a row. The instance is restarted whole only once
every rank has ended or is still waiting to join. The supervisor hosts the store its ranks agree
in, which so outlives any of them. `stop()` (or Ctrl-C, SIGTERM under `serve`) stops them all.

On GPUs (device auto or cuda), the n-th rank started, counting over instances, runs on GPU n
mod the GPU count: on 8 GPUs a prefill and a decode instance of 4 ranks each take GPUs 0-3
and 4-7; on one GPU they all share it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
import torch.distributed as dist
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ref_server.services.config import ServeConfig
from ref_server.services.elastic import last_members
from ref_server.services.security import SECRET_ENV, new_secret, read_secret
from ref_server.services.servers import SUPERVISOR_ENV, supervised_service

log = logging.getLogger(__name__)
# After the first, second, ... death in a row; one more without a healthy start between, and
# the deployment gives up.
RESTART_DELAYS_S = (1, 2, 5, 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_free(host: str, port: int, what: str) -> None:
    """OSError naming the port if something listens on it already (a second deployment would
    otherwise find the first one answering its readiness checks)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as error:
            raise OSError(
                f"{what} {host}:{port} is in use ({error.strerror}): another ref-server? "
                "Stop it or choose other ports"
            ) from None


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


def serve_command(config: ServeConfig, **launch) -> list[str]:
    """The command line that runs `config` with the `launch` fields changed; the internal
    secret is not on it (the environment carries it)."""
    command = [sys.executable, "-m", "ref_server", "serve"]
    launched = dataclasses.replace(config, **launch)
    for f in dataclasses.fields(ServeConfig):
        if f.name.endswith("_instances") or f.name == "internal_secret_file":
            continue
        value = getattr(launched, f.name)
        if isinstance(value, list):
            value = ",".join(value)
        flag = f.name.replace("_", "-")
        if isinstance(value, bool):
            command.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None and value != "":
            command += [f"--{flag}", str(value)]
    return command


def stop_on_signals() -> threading.Event:
    """An event set by SIGINT or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_serving(
    address: str,
    timeout: float,
    process: subprocess.Popen | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    service: str = "",
) -> None:
    """Until the health service at `address` says `service` is SERVING; RuntimeError after
    `timeout` or if `process` exits first."""
    deadline = time.monotonic() + timeout
    if credentials is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, credentials)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"the process for {address} exited with {process.returncode}")
            try:
                request = health_pb2.HealthCheckRequest(service=service)
                if stub.Check(request, timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"{address} was not SERVING within {timeout:g} s")


@dataclass(eq=False)
class Unit:
    """What the supervisor restarts as one: an instance's ranks, or the router."""

    role: str
    commands: dict[str, list[str]]  # by gRPC address, in rank order (an elastic rank's member id)
    elastic: bool = False  # the instance goes on while any rank lives
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    deaths: int = 0  # in a row, without a healthy start between
    restart_at: float | None = None
    store: dist.TCPStore | None = None  # an elastic instance's, where its ranks agree
    # an elastic instance's ranks, by address: those whose process ended, the deaths of each in
    # a row (without serving between), when each restarts, and those restarted but not serving
    lost: set[str] = field(default_factory=set)
    rank_deaths: dict[str, int] = field(default_factory=dict)
    rejoin_at: dict[str, float] = field(default_factory=dict)
    joining: set[str] = field(default_factory=set)

    def start(self, env: dict[str, str]) -> None:
        if self.elastic:  # a new store each start: the old one holds the last start's members
            port = free_port()
            self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
            for command in self.commands.values():
                command[command.index("--group-address") + 1] = f"127.0.0.1:{port}"
            self.lost, self.rank_deaths, self.rejoin_at, self.joining = set(), {}, {}, set()
        self.processes = {a: subprocess.Popen(c, env=env) for a, c in self.commands.items()}

    def rejoin(self, address: str, env: dict[str, str]) -> subprocess.Popen:
        """Start an elastic instance's lost rank again, as a replacement that joins it (the
        last of --no-join and --join on a command line wins)."""
        self.lost.discard(address)
        self.joining.add(address)
        process = subprocess.Popen([*self.commands[address], "--join"], env=env)
        self.processes[address] = process
        return process

    def ended(self) -> dict[str, int]:
        """The exit codes of the processes that ended, by address."""
        return {a: p.poll() for a, p in self.processes.items() if p.poll() is not None}

    def dead(self) -> bool:
        """Whether it must start again: an elastic instance once every rank has ended or
        waits to join (no member is left to admit it). A replacement that the members have
        admitted (its member id in the store's last members) is one, serving or not yet."""
        ended = self.ended()
        if not self.elastic:
            return bool(ended)
        members = last_members(self.store) or []
        waiting = {a for i, a in enumerate(self.commands) if a in self.joining and i not in members}
        return all(a in ended or a in waiting for a in self.processes)

    def kill(self, timeout: float = 10) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class Deployment:
    def __init__(self, config: ServeConfig, startup_timeout: float = 600.0) -> None:
        self.config = config
        check_free(config.host, config.port, "the gRPC port")
        if config.http_port:
            check_free(config.host, config.http_port, "the HTTP port")
        self.failure: str | None = None  # why the supervisor gave up; the deployment is stopped
        secret = read_secret(config.internal_secret_file) or new_secret()
        self.env = {**os.environ, SECRET_ENV: secret, SUPERVISOR_ENV: str(os.getpid())}
        self.startup_timeout = startup_timeout
        self.instances = self._instances()
        self.address = f"{reachable(config.host)}:{config.port}"
        peers = {role: self.addresses(role) for role in ("prefill", "decode")}
        self.router = Unit("router", {self.address: serve_command(config, role="router", **peers)})
        self.stopping = threading.Event()
        self.supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        try:
            for unit in self.instances:
                unit.start(self.env)
            for unit in self.instances:
                self._wait(unit)
            self.router.start(self.env)
            self._wait(self.router)
        except BaseException:
            self.stop()
            raise
        self.supervisor.start()

    @property
    def units(self) -> list[Unit]:
        return [*self.instances, self.router]

    @property
    def children(self) -> dict[str, subprocess.Popen]:
        """Every process, by its gRPC address."""
        return {a: p for u in self.units for a, p in u.processes.items()}

    def addresses(self, role: str) -> list[str]:
        return [a for u in self.instances if u.role == role for a in u.commands]

    def _instances(self) -> list[Unit]:
        from ref_server.services.servers import expert_slots, model_args, torch_device

        config = self.config
        on_gpus = torch_device(config).type == "cuda"  # a clear error when there is none
        expert_slots(config, model_args(config))  # and a bad expert placement
        gpus = torch.cuda.device_count() if on_gpus and config.device in ("auto", "cuda") else 0
        units, started = [], 0
        roles = ["prefill"] * config.prefill_instances + ["decode"] * config.decode_instances
        for role in roles:
            group_address = f"127.0.0.1:{free_port()}" if config.ranks > 1 else None
            commands = {}
            elastic = config.elastic and config.ranks > 1
            for rank in range(config.ranks):  # the router balances over every rank
                port = free_port()
                launch = dict(role=role, host="127.0.0.1", port=port, rank=rank)
                launch["group_address"] = group_address
                if elastic:  # at a store of the supervisor's (Unit.start)
                    launch["group_store"] = "external"
                if gpus:
                    launch["device"] = f"cuda:{started % gpus}"
                started += 1
                commands[f"127.0.0.1:{port}"] = serve_command(config, **launch)
            units.append(Unit(role, commands, elastic))
        return units

    def _wait(self, unit: Unit) -> None:
        credentials = None
        if unit is self.router and self.config.tls_cert:  # the chain up to its root, or self-signed
            roots = Path(self.config.tls_cert).read_bytes()
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
        service = supervised_service(os.getpid())  # not another deployment on these ports
        for address, process in unit.processes.items():
            wait_serving(address, self.startup_timeout, process, credentials, service)

    def _supervise(self) -> None:
        while not self.stopping.wait(0.5):
            for unit in self.units:
                self._look_after(unit)

    def _look_after(self, unit: Unit) -> None:
        now = time.monotonic()
        if unit.restart_at is None:
            if not unit.dead():
                self._look_after_ranks(unit, now)
                return
            codes = {a: p.poll() for a, p in unit.processes.items()}
            unit.kill()  # the other ranks of a broken instance cannot go on alone
            unit.deaths += 1
            if unit.deaths > len(RESTART_DELAYS_S):
                self.failure = (
                    f"the {unit.role} at {', '.join(codes)} died {unit.deaths} times in a row "
                    f"without serving (exit codes {list(codes.values())}); see its log above"
                )
                log.error("%s: stopping", self.failure)
                self.stopping.set()
                return
            delay = RESTART_DELAYS_S[unit.deaths - 1]
            log.warning("%s %s died (%s); restarting in %d s", unit.role, list(codes), codes, delay)
            unit.restart_at = now + delay
        elif now >= unit.restart_at and not self.stopping.is_set():
            unit.restart_at = None
            unit.start(self.env)
            threading.Thread(target=self._healthy_again, args=(unit,), daemon=True).start()

    def _look_after_ranks(self, unit: Unit, now: float) -> None:
        """An elastic instance's lost ranks: each restarted alone to join it (`Unit.rejoin`)
        after RESTART_DELAYS_S, counted per rank, until it has died once more than there are
        delays."""
        for address, code in unit.ended().items():
            if address not in unit.lost:
                unit.lost.add(address)
                unit.joining.discard(address)
                deaths = unit.rank_deaths[address] = unit.rank_deaths.get(address, 0) + 1
                left = len(unit.processes) - len(unit.lost) - len(unit.joining)
                if deaths > len(RESTART_DELAYS_S):
                    log.error(
                        "%s rank %s ended %d times in a row without serving (exit code %s; see "
                        "its log above): no more restarts; its instance goes on over %d ranks",
                        unit.role, address, deaths, code, left,
                    )  # fmt: skip
                    continue
                delay = RESTART_DELAYS_S[deaths - 1]
                log.warning(
                    "%s rank %s ended (exit code %s); its instance goes on over %d ranks; "
                    "restarting the rank to join it in %d s",
                    unit.role, address, code, left, delay,
                )  # fmt: skip
                unit.rejoin_at[address] = now + delay
            elif address in unit.rejoin_at and now >= unit.rejoin_at[address]:
                if self.stopping.is_set():
                    return
                del unit.rejoin_at[address]
                process = unit.rejoin(address, self.env)
                joined = threading.Thread(
                    target=self._joined, args=(unit, address, process), daemon=True
                )
                joined.start()

    def _joined(self, unit: Unit, address: str, process: subprocess.Popen) -> None:
        """Once the restarted rank serves, it was admitted: a member again."""
        try:
            service = supervised_service(os.getpid())
            wait_serving(address, self.startup_timeout, process, service=service)
        except RuntimeError as error:
            log.warning("%s rank %s did not join: %s", unit.role, address, error)
            return
        if unit.processes.get(address) is process:  # not restarted whole meanwhile
            unit.joining.discard(address)
            unit.rank_deaths[address] = 0

    def _healthy_again(self, unit: Unit) -> None:
        try:
            self._wait(unit)
            unit.deaths = 0
        except RuntimeError as error:
            log.warning("%s did not come back: %s", unit.role, error)

    def stop(self) -> None:
        self.stopping.set()
        if self.supervisor.is_alive():
            self.supervisor.join(timeout=5)
        self.router.kill()  # the router first: no new requests reach dying instances
        for unit in sorted(self.instances, key=lambda u: u.role != "decode"):
            unit.kill()  # decode instances before the prefill caches they map


def reachable(host: str) -> str:
    """Where this machine reaches a server listening on `host` (all interfaces: loopback)."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
