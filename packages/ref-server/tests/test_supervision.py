"""`--role all`'s ports and supervisor (CPU, real processes): a taken port is refused before
anything starts, no server shares its port, the HTTP port takes connections as soon as it is
bound, readiness is asked of the supervisor's own child, and a process that keeps dying stops
the deployment instead of restarting forever."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ref_server.services import deployment
from ref_server.services.deployment import Deployment, Unit, free_port, wait_serving
from ref_server.services.servers import supervised_service


def listener(port: int) -> socket.socket:
    """A listening socket that allows others on its port, as grpcio's own servers do."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def ref_server(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "REF_SERVER_INTERNAL_SECRET": "s"}
    return subprocess.run(
        [sys.executable, "-m", "ref_server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize("taken", ["port", "http-port"])
def test_serve_refuses_a_taken_port_in_one_line_before_it_starts_a_process(taken):
    ports = {"port": free_port(), "http-port": free_port()}
    with listener(ports[taken]):
        result = ref_server(
            "serve", "--device", "cpu", "--port", str(ports["port"]),
            "--http-port", str(ports["http-port"]),
        )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    what = "gRPC" if taken == "port" else "HTTP"
    assert line.startswith(f"ref-server serve: error: the {what} port 127.0.0.1:{ports[taken]}")
    assert "is in use" in line and "another ref-server?" in line


def test_a_router_does_not_share_a_port_that_another_server_listens_on():
    port = free_port()
    with listener(port):
        result = ref_server(
            "serve", "--role", "router", "--device", "cpu", "--port", str(port),
            "--http-port", "0", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2",
        )  # fmt: skip
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in result.stderr


def test_the_http_port_takes_connections_before_uvicorn_starts():
    from ref_server.services.http_server import HttpServer

    server = HttpServer(None, "127.0.0.1", 0, None, None)
    try:
        with socket.create_connection(server.socket.getsockname(), timeout=5):
            pass  # queued in the backlog; refused before the port listened at bind time
    finally:
        server.socket.close()


@pytest.fixture
def foreign_server():
    """A gRPC server on a free port whose health service says SERVING, as another
    deployment's router would."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_readiness_is_asked_of_the_supervisors_own_child(foreign_server):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        wait_serving(foreign_server, 5, child)  # any server's SERVING would do for ""
        with pytest.raises(RuntimeError, match="was not SERVING within 1 s"):
            wait_serving(foreign_server, 1, child, service=supervised_service(os.getpid()))
    finally:
        child.kill()
        child.wait()


def supervisor_only() -> Deployment:
    """A deployment without processes, whose supervisor's steps (`_look_after`) the test runs."""
    running = Deployment.__new__(Deployment)
    running.config = type("Config", (), {"tls_cert": None})()
    running.env = dict(os.environ)
    running.startup_timeout = 2
    running.stopping = threading.Event()
    running.failure = None
    return running


def test_the_supervisor_gives_up_on_a_process_that_keeps_dying(monkeypatch, foreign_server):
    """A router that exits at once while another deployment answers on its port: restarted
    after each death (never counted healthy, since the other one is not its child), then the
    deployment stops with one message instead of restarting it forever."""
    monkeypatch.setattr(deployment, "RESTART_DELAYS_S", (0, 0, 0, 0))
    running = supervisor_only()
    router = Unit("router", {foreign_server: [sys.executable, "-c", "raise SystemExit(3)"]})
    running.router, running.instances = router, []
    router.start(running.env)
    starts = 1
    while not running.stopping.is_set():
        previous = router.processes
        running._look_after(router)
        if router.processes is not previous:
            starts += 1
        assert starts <= 5
    assert starts == 5 and router.deaths == 5
    assert running.failure == (
        f"the router at {foreign_server} died 5 times in a row without serving "
        "(exit codes [3]); see its log above"
    )


def rank(code: str) -> list[str]:
    """A stand-in for an elastic instance's rank: `code` runs with the rank's flags in sys.argv."""
    return [sys.executable, "-c", code, "--group-address", "127.0.0.1:1"]


def supervised(running: Deployment, unit: Unit, address: str, until) -> list[subprocess.Popen]:
    """The processes at `address` as the supervisor's steps start them, until `until(them)`
    (within 30 s)."""
    started = [unit.processes[address]]
    deadline = time.monotonic() + 30
    while not until(started):
        assert time.monotonic() < deadline, (
            f"only {len(started)} processes started at {address} in 30 s"
        )
        running._look_after(unit)
        if unit.processes[address] is not started[-1]:
            started.append(unit.processes[address])
        time.sleep(0.01)
    return started


def test_a_lost_elastic_rank_is_restarted_alone_to_join_until_it_keeps_failing(monkeypatch):
    """An elastic instance's rank whose process ends is started again alone, its command plus
    --join; one that keeps ending (as a replacement that is never admitted exits, code 2) is
    started five times in all, then the instance goes on without it: the other rank is the
    process it was and the deployment goes on."""
    monkeypatch.setattr(deployment, "RESTART_DELAYS_S", (0, 0, 0, 0))
    running = supervisor_only()
    live, failing = "127.0.0.1:1", "127.0.0.1:2"
    commands = {live: rank("import time; time.sleep(60)"), failing: rank("raise SystemExit(2)")}
    unit = Unit("decode", commands, elastic=True)
    running.router, running.instances = None, [unit]
    unit.start(running.env)
    survivor = unit.processes[live]
    try:
        started = supervised(
            running, unit, failing, lambda p: len(p) == 5 and p[-1].poll() is not None
        )
        for _ in range(20):
            running._look_after(unit)
        assert unit.processes[failing] is started[-1]  # no sixth
        assert "--join" not in started[0].args
        assert all(process.args[-1] == "--join" for process in started[1:])
        assert unit.processes[live] is survivor and survivor.poll() is None
        assert not running.stopping.is_set() and running.failure is None
    finally:
        unit.kill()


@pytest.mark.parametrize("admitted", [False, True])
def test_an_elastic_instance_whose_members_all_ended_restarts_whole_stopping_its_joiner(
    monkeypatch, admitted
):
    """A rank is lost and restarted with --join (a replacement waiting to be admitted); the
    other, its last member, ends too: the replacement, which nothing can admit any more, is
    stopped and the instance restarts whole, without --join. Unless the members had admitted
    it (the store's last members name it) before it serves: then it is the instance, and goes
    on alone."""
    monkeypatch.setattr(deployment, "RESTART_DELAYS_S", (0, 0, 0, 0))
    running = supervisor_only()
    member, lost = "127.0.0.1:1", "127.0.0.1:2"
    waits_if_joining = "import sys, time; time.sleep(60 if '--join' in sys.argv else 0)"
    commands = {member: rank("import time; time.sleep(60)"), lost: rank(waits_if_joining)}
    unit = Unit("decode", commands, elastic=True)
    running.router, running.instances = None, [unit]
    unit.start(running.env)
    try:
        joiner = supervised(running, unit, lost, lambda p: len(p) == 2)[-1]
        assert joiner.args[-1] == "--join" and joiner.poll() is None
        if admitted:
            unit.store.set("members/1", json.dumps([0, 1]))
        unit.processes[member].kill()
        unit.processes[member].wait()
        running._look_after(unit)
        if admitted:
            running._look_after(unit)
            assert unit.processes[lost] is joiner and joiner.poll() is None
            assert unit.restart_at is None
            return
        # all ended or joining: stopped
        assert joiner.poll() is not None
        running._look_after(unit)  # started again whole, after a delay of 0
        assert unit.processes[member].poll() is None and unit.processes[lost] is not joiner
        assert all("--join" not in process.args for process in unit.processes.values())
    finally:
        unit.kill()
