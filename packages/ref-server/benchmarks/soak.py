"""Mixed traffic against `ref-server serve --role all` on loopback for a long while, an instance
killed every few minutes: does every request end as documented, and is the deployment as it
was afterwards?

    python benchmarks/soak.py [--minutes 30] [--clients 12] [--kill-every 5] [--preset tiny]
                              [--device cpu] [--json results.json]

`--clients` threads each send one request at a time, drawn at random: streams to the end over
gRPC and HTTP (completions and chat, `n` up to 4, stop strings, sampling), streams the client
cancels at a random point (before the first token too), Router.Abort right after the first
chunk, prompts near the context limit, and bad requests. Every `--kill-every` minutes one
instance (prefill and decode in turn) is killed with SIGKILL; the supervisor restarts it.

An outcome is "completed", a "documented error" (gRPC INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
UNAVAILABLE, DEADLINE_EXCEEDED, NOT_FOUND for a late Abort; HTTP 400, 404, 413, 429, 503, 504
with an OpenAI-style body; our own cancel), or "undocumented" (anything else: UNKNOWN,
INTERNAL, a 500, a request past its timeout). At the end, with traffic stopped, it asserts:
no undocumented outcome, every page free and nothing running or queued within 30 s, and each
process's threads, open files and resident memory within a bound of their level after a
minute of its current life (the router lives through the run; an instance from its restart).
Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import httpx

from ref_server.client import Client
from ref_server.services.deployment import free_port

DOCUMENTED_GRPC = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"}
DOCUMENTED_HTTP = {400, 404, 413, 429, 503, 504}
REQUEST_TIMEOUT_S = 120  # a request that takes longer has stalled
# Growth allowed over a process's level a minute into its life.
BOUNDS = {"threads": 16, "open_files": 32, "rss_fraction": 0.3}
CONTEXT = 1024


@dataclass
class Tally:
    start: float = field(default_factory=time.monotonic)
    outcomes: Counter = field(default_factory=Counter)  # (scenario, outcome) -> count
    errors: Counter = field(default_factory=Counter)  # documented errors by code
    undocumented: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, scenario: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[(scenario, outcome)] += 1
            if outcome == "documented error":
                self.errors[detail[:80]] += 1
            if outcome == "undocumented":
                at = time.monotonic() - self.start
                self.undocumented.append(f"{at:.0f} s, {scenario}: {detail}"[:300])


def prompt(rng: random.Random, length: int | None = None) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(length or rng.randint(4, 96))]


# ---------------------------------------------------------------- the scenarios


def grpc_outcome(error: grpc.RpcError, documented=DOCUMENTED_GRPC) -> tuple[str, str]:
    code = error.code().name
    outcome = "documented error" if code in documented else "undocumented"
    return outcome, f"{code}: {error.details()}"


def grpc_stream(client: Client, rng: random.Random, cancel: bool, long: bool = False):
    length = rng.randint(CONTEXT - 80, CONTEXT - 40) if long else None
    max_tokens = rng.randint(1, 32)
    sampling = {"max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]), "seed": 7}
    if rng.random() < 0.3:
        sampling["stop"] = ["a", "\n"]
    call = client.responses(prompt(rng, length), timeout=REQUEST_TIMEOUT_S, **sampling)
    stop_at = rng.randint(0, max_tokens) if cancel else None
    chunks, complete = 0, False
    try:
        for response in call:
            kind = response.WhichOneof("payload")
            if kind == "chunk":
                chunks += 1
            complete = complete or kind == "complete"
            if stop_at is not None and chunks >= stop_at:
                call.cancel()
                return "cancelled", ""
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.CANCELLED and stop_at is not None:
            return "cancelled", ""
        return grpc_outcome(error)
    return ("completed", "") if complete else ("undocumented", "a stream without complete")


def grpc_abort(client: Client, rng: random.Random):
    request_id = f"soak-{rng.getrandbits(48):x}"
    call = client.responses(prompt(rng), request_id=request_id, max_tokens=48,
                            timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    try:
        first = next(call)
        if first.WhichOneof("payload") == "chunk":
            try:
                client.abort(request_id)
            except grpc.RpcError as error:  # it may have ended already
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    return grpc_outcome(error)
        reasons = [r.complete.finish_reason for r in call if r.WhichOneof("payload") == "complete"]
    except grpc.RpcError as error:
        return grpc_outcome(error)
    return ("completed", "") if reasons else ("undocumented", "no complete after an abort")


def grpc_bad(client: Client, rng: random.Random):
    bad = rng.choice(
        [
            dict(max_tokens=0),
            dict(max_tokens=8, temperature=-1.0),
            dict(max_tokens=8, top_p=2.0),
            dict(max_tokens=CONTEXT + 1),
        ]
    )
    tokens = rng.choice([[5, 6, 7], [10**6], []])
    try:
        list(client.responses(tokens, timeout=REQUEST_TIMEOUT_S, **bad))
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return "documented error", "INVALID_ARGUMENT"
        return grpc_outcome(error)
    return "undocumented", f"accepted {bad} {tokens}"


def http_outcome(response: httpx.Response) -> tuple[str, str]:
    if response.status_code == 200:
        return "completed", ""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "undocumented", f"{response.status_code} without an OpenAI-style body"
    if response.status_code in DOCUMENTED_HTTP:
        return "documented error", f"{response.status_code}: {message}"
    return "undocumented", f"{response.status_code}: {message}"


def http_request(http: httpx.Client, rng: random.Random, stream: bool, leave: bool = False):
    chat = rng.random() < 0.4
    body = {"model": "tiny", "max_tokens": rng.randint(1, 24), "n": rng.randint(1, 4)}
    body["temperature"] = rng.choice([0, 0.7])
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": "héllo wörld 你好 " * rng.randint(1, 8)}]
    else:
        path, body["prompt"] = "/v1/completions", prompt(rng)
    if not stream:
        return http_outcome(http.post(path, json=body))
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            response.read()
            return http_outcome(response)
        events = 0
        leave_at = rng.randint(0, 6) if leave else None
        tail = b""
        for piece in response.iter_bytes():
            events += piece.count(b"\n\n")
            tail = (tail + piece)[-64:]
            if leave_at is not None and events >= leave_at:
                return "cancelled", ""  # leaving the with-block closes the connection
    if tail.endswith(b"data: [DONE]\n\n"):
        return "completed", ""
    return "undocumented", f"a stream that ended without [DONE]: {tail!r}"


def http_bad(http: httpx.Client, rng: random.Random):
    body = rng.choice(
        [
            b"{not json",
            b'{"model": "tiny", "prompt": "x", "max_tokens": -1}',
            b'{"model": "tiny", "prompt": [999999], "max_tokens": 2}',
            b'{"model": "other", "prompt": "x", "max_tokens": 2}',
            b'{"model": "tiny", "messages": "x"}',
        ]
    )
    response = http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    return http_outcome(response)


SCENARIOS = {  # name: (weight, function(client, http, rng))
    "grpc stream": (4, lambda c, h, r: grpc_stream(c, r, cancel=False)),
    "grpc cancel": (2, lambda c, h, r: grpc_stream(c, r, cancel=True)),
    "grpc abort": (1, lambda c, h, r: grpc_abort(c, r)),
    "grpc long prompt": (1, lambda c, h, r: grpc_stream(c, r, cancel=False, long=True)),
    "grpc bad": (1, lambda c, h, r: grpc_bad(c, r)),
    "http": (2, lambda c, h, r: http_request(h, r, stream=False)),
    "http stream": (2, lambda c, h, r: http_request(h, r, stream=True)),
    "http leave": (1, lambda c, h, r: http_request(h, r, stream=True, leave=True)),
    "http bad": (1, lambda c, h, r: http_bad(h, r)),
}


def client_loop(address: str, base_url: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    names = list(SCENARIOS)
    weights = [SCENARIOS[n][0] for n in names]
    with (
        Client(address) as client,
        httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http,
    ):
        while time.monotonic() < until:
            name = rng.choices(names, weights)[0]
            try:
                outcome, detail = SCENARIOS[name][1](client, http, rng)
            except (httpx.TimeoutException, grpc.RpcError) as error:
                outcome, detail = "undocumented", repr(error)
            except httpx.HTTPError as error:  # a connection the router dropped
                outcome, detail = "undocumented", repr(error)
            tally.add(name, outcome, detail)


# ---------------------------------------------------------------- the processes


def children(pid: int) -> dict[str, int]:
    """The serve process's children by role (router, prefill, decode), from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"--role" in args:
            found[args[args.index(b"--role") + 1].decode()] = int(entry)
    return found


def usage(pid: int) -> dict[str, float]:
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return {
        "threads": int(status["Threads"]),
        "open_files": len(os.listdir(f"/proc/{pid}/fd")),
        "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
    }


@dataclass
class Life:
    """One process's life: when it started (as seen) and its samples."""

    pid: int
    seen: float
    samples: list[tuple[float, dict]] = field(default_factory=list)

    def growth(self) -> dict[str, float] | None:
        settled = [u for t, u in self.samples if t >= self.seen + 60]
        if len(settled) < 2:
            return None
        first, last = settled[0], settled[-1]
        return {
            "threads": last["threads"] - first["threads"],
            "open_files": last["open_files"] - first["open_files"],
            "rss_fraction": last["rss_mb"] / first["rss_mb"] - 1,
            "rss_mb": last["rss_mb"],
        }


def watch(serve_pid: int, until: float, kill_every: float, lives: dict, kills: list) -> None:
    """Sample every process each 10 s, kill an instance every `kill_every` seconds."""
    next_kill, victims = time.monotonic() + kill_every, ["prefill", "decode"]
    while time.monotonic() < until:
        now = time.monotonic()
        for role, pid in children(serve_pid).items():
            life = lives.get(role)
            if life is None or life.pid != pid:
                life = lives[role] = Life(pid, now)
            with contextlib.suppress(OSError):  # it died since
                life.samples.append((now, usage(pid)))
        if now >= next_kill:
            role = victims[len(kills) % 2]
            pid = children(serve_pid).get(role)
            if pid:
                os.kill(pid, signal.SIGKILL)
                kills.append((round(now), role))
            next_kill += kill_every
        time.sleep(10)


def idle(client: Client) -> bool:
    info = client.server_info()
    return bool(info.workers) and all(
        w.healthy and not (w.load.kv_usage or w.load.held or w.load.running or w.load.waiting)
        for w in info.workers
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--kill-every", type=float, default=5, metavar="MINUTES")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    port, http_port = free_port(), free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "ref_server", "serve", "--preset", args.preset, "--device",
         args.device, "--port", str(port), "--http-port", str(http_port), "--max-model-len",
         str(CONTEXT), "--max-inflight", "256", "--log-level", "warning"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for ready in serve.stdout:  # the instances' own lines come first
            if ready.startswith("ref-server: serving on"):
                break
        else:
            raise SystemExit("soak: the deployment did not start")
        address, base_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
        start = time.monotonic()
        until = start + args.minutes * 60
        tally, lives, kills = Tally(), {}, []
        watcher = threading.Thread(
            target=watch, args=(serve.pid, until, args.kill_every * 60, lives, kills), daemon=True
        )
        watcher.start()
        with ThreadPoolExecutor(args.clients) as pool:
            for seed in range(args.clients):
                pool.submit(client_loop, address, base_url, seed, until, tally)
        watcher.join()
        with Client(address) as client:
            deadline = time.monotonic() + 30
            while not idle(client) and time.monotonic() < deadline:
                time.sleep(0.5)
            settled = idle(client)
            final = client.server_info()
        growth = {role: life.growth() for role, life in lives.items()}
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)
    report = {
        "minutes": args.minutes,
        "clients": args.clients,
        "kills": kills,
        "outcomes": {f"{s} / {o}": n for (s, o), n in sorted(tally.outcomes.items())},
        "documented_errors": dict(tally.errors.most_common()),
        "undocumented": tally.undocumented[:50],
        "idle_after_30s": settled,
        "workers_at_end": [
            {
                "name": w.name,
                "healthy": w.healthy,
                "kv_usage": w.load.kv_usage,
                "held": w.load.held,
                "running": w.load.running,
                "waiting": w.load.waiting,
            }
            for w in final.workers
        ],
        "growth": growth,
        "bounds": BOUNDS,
    }
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    over = [
        f"{role} {name} {value:+.3g}"
        for role, g in growth.items()
        if g
        for name, value in g.items()
        if name in BOUNDS and value > BOUNDS[name]
    ]
    problems = (["undocumented outcomes"] if tally.undocumented else []) + over
    problems += [] if settled else ["pages or requests left after 30 s"]
    print("soak:", "PASSED" if not problems else "FAILED: " + "; ".join(problems))
    return 0 if not problems else 1


def print_report(report: dict) -> None:
    print(f"{report['minutes']:g} minutes, {report['clients']} clients, instances killed at "
          f"{', '.join(f'{t}s {r}' for t, r in report['kills']) or 'none'}")  # fmt: skip
    totals = Counter()
    print(f"{'scenario':<18} {'outcome':<18} {'count':>7}")
    for key, count in report["outcomes"].items():
        scenario, outcome = key.split(" / ")
        totals[outcome] += count
        print(f"{scenario:<18} {outcome:<18} {count:>7}")
    print("totals: " + ", ".join(f"{o} {n}" for o, n in totals.most_common()))
    print(
        "documented errors: "
        + ", ".join(f"{c} {n}" for c, n in report["documented_errors"].items())
    )
    for line in report["undocumented"][:10]:
        print(f"  undocumented: {line}")
    print(f"idle within 30 s of the end: {report['idle_after_30s']}")
    for role, g in report["growth"].items():
        if g:
            print(f"{role:<8} growth over its life after a minute: threads {g['threads']:+d}, "
                  f"open files {g['open_files']:+d}, RSS {g['rss_fraction']:+.1%} "
                  f"({g['rss_mb']:.0f} MB)")  # fmt: skip
        else:
            print(f"{role:<8} lived under two minutes at the end: no growth measured")


if __name__ == "__main__":
    sys.exit(main())
