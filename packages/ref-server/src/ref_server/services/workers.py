"""The router's view of its instances: health, registration, loads, cached prefixes, and the
choice of an instance for a request.

Every `interval` seconds the pool checks each instance's health and reads its load (one call
each, in parallel, off the request path). An instance is dropped after `failures` checks or
calls in a row fail and taken back at the first good check. When it comes back it is
registered again: it says what it runs (`InstanceInfo`), which must agree with the router and
the other instances (model, layers, page size, cache width and dtype, whether it drafts with
the MTP module), and a decode instance
learns the healthy prefill instances, the only peers it will pull KV from (and drops what it
kept of any other): every check round tells it, and a decode instance is routed to only while
that succeeds, so it always knows the prefill instances it is sent requests from.

The choice is `ref_server.balance.instances`' (pure functions over `InstanceLoad` snapshots,
made here). No call is made to choose: the prefill instances' cached prefixes are the
router's own `PrefixIndex`, which the router feeds with what each prefill left cached
(`prefilled`); an instance's entries go when it is dropped or registers again (a new cache).

The router is SERVING while at least one prefill and one decode instance are healthy and
none disagrees with the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ref_server.balance import InstanceLoad, PrefillPolicy, PrefixIndex
from ref_server.balance import instances as balancer
from ref_server.balance.prefix_index import DEFAULT_PAGES_PER_INSTANCE
from ref_server.services.security import internal_channel
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

log = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class Expected:
    """What every instance must run, as the router's own configuration says."""

    model_fingerprint: str
    num_layers: int
    page_size: int
    cache_width: int
    # a decode instance that drafts needs the hidden state a prefill instance that drafts hands over
    speculative: bool = False

    def problem(self, info: pb.InstanceInfo, cache_dtype: str | None) -> str:
        """Why an instance that says `info` cannot serve with the others ("" if it can)."""
        wrong = [
            f"{name} {getattr(info, name)!r}, not {want!r}"
            for name, want in (
                ("model_fingerprint", self.model_fingerprint),
                ("num_layers", self.num_layers),
                ("page_size", self.page_size),
                ("cache_width", self.cache_width),
                ("cache_dtype", cache_dtype or info.cache_dtype),
                ("speculative", self.speculative),
            )
            if getattr(info, name) != want
        ]
        return f"{info.model}: " + "; ".join(wrong) if wrong else ""


@dataclass(eq=False)
class Worker:
    name: str
    role: str
    address: str
    secret: str
    healthy: bool = False
    routable: bool = False  # healthy, registered, and (prefill) known to every decode instance
    failures: int = 0
    info: pb.InstanceInfo | None = None
    problem: str = ""
    load: pb.WorkerLoad = field(default_factory=pb.WorkerLoad)
    assigned: int = 0  # this router's requests in flight there (loads lag behind)
    routed_tokens: int = 0  # prompt tokens this router sent there since its load was read
    # set when it is dropped: calls in flight there end (`cancel_when_down`)
    went_down: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.channel = internal_channel(
            self.address, self.secret, **{"grpc.max_receive_message_length": 64 << 20}
        )
        self.instance = rpc.InstanceStub(self.channel)
        self.prefill = rpc.PrefillStub(self.channel)
        self.decode = rpc.DecodeStub(self.channel)
        self.kv = rpc.KvTransferStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def cancel_when_down(self, call) -> asyncio.Future:
        """A watch that cancels `call` (made to this worker) if the worker is dropped first:
        a process that stopped (SIGSTOP, a hung host) keeps its connections open, so the call
        alone would wait out the request's deadline. Once the watch is done and not cancelled,
        the call's CancelledError means the worker went down. Cancel the watch with the call."""
        watch = asyncio.ensure_future(self.went_down.wait())
        watch.add_done_callback(lambda done: done.cancelled() or call.cancel())
        return watch

    @property
    def share(self) -> float:
        """The share of its ranks its instance serves with (1 but after an elastic instance
        lost some): its steps take longer by as much, so it counts for as much less."""
        load = self.load
        return load.ranks / load.configured_ranks if load.configured_ranks else 1.0

    @property
    def capacity(self) -> int:
        """The sequences it runs at once, for as much as its instance serves with."""
        return int(self.info.max_running * self.share) if self.info else 0

    def snapshot(self) -> InstanceLoad:
        load = self.load
        return InstanceLoad(
            name=self.name,
            queued_tokens=round((load.queued_tokens + self.routed_tokens) / self.share),
            queued_flops=load.queued_flops,
            running=load.running,
            kv_usage=load.kv_usage,
            assigned=self.assigned,
            capacity=self.capacity,
        )


@dataclass(frozen=True)
class PrefillChoice:
    worker: Worker
    cached_pages: int  # of the request's, as the prefix index guesses
    rule: str  # which rule chose it: balancer.PREFIX or LOAD


class WorkerPool:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        expected: Expected,
        secret: str,
        on_update: Callable[[], None],
        interval: float = 1.0,
        failures: int = 3,
        policy: PrefillPolicy | None = None,
        prefix_index_pages: int = DEFAULT_PAGES_PER_INSTANCE,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode address")
        self.workers = [
            Worker(f"{role}-{i}", role, address, secret)
            for role, addresses in (("prefill", prefill), ("decode", decode))
            for i, address in enumerate(addresses)
        ]
        self.expected = expected
        self.on_update = on_update  # after each check round, and when a worker drops
        self.interval, self.max_failures = interval, failures
        self.cache_dtype: str | None = None  # the first registered instance's: all must agree
        self.policy = policy or PrefillPolicy()
        self.prefixes = PrefixIndex(prefix_index_pages)
        self._task: asyncio.Task | None = None

    def of(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    @property
    def problem(self) -> str:
        """Why the router cannot serve ("" when it can)."""
        wrong = [f"{w.name}: {w.problem}" for w in self.workers if w.problem]
        if wrong:
            return "instances disagree: " + "; ".join(wrong)
        missing = [r for r in ("prefill", "decode") if not any(w.routable for w in self.of(r))]
        return f"no healthy {' or '.join(missing)} instance" if missing else ""

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await asyncio.gather(*(w.channel.close() for w in self.workers))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check_all()
            except Exception:  # never let the watcher die
                log.exception("health check round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.workers))
        await self._register_peers()
        self.on_update()

    async def _check(self, worker: Worker) -> None:
        timeout = max(self.interval, 1.0)
        try:
            check = await worker.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            if check.status != SERVING:
                raise ConnectionError("not serving")
            if worker.info is None:
                await self._register(worker)
            worker.load = await worker.instance.GetLoad(pb.GetLoadRequest(), timeout=timeout)
            worker.routed_tokens = 0  # the load counts them now (roughly: some may be on the way)
        except (grpc.aio.AioRpcError, ConnectionError):
            self.failed(worker)
            return
        worker.failures = 0
        if not worker.healthy:
            worker.went_down = asyncio.Event()
        worker.healthy = True

    async def _register(self, worker: Worker) -> None:
        peers = [w.address for w in self.of("prefill") if w.routable]
        request = pb.RegisterRequest(prefill_addresses=peers if worker.role == "decode" else [])
        info = await worker.instance.Register(request, timeout=max(self.interval, 1.0))
        self.prefixes.drop(worker.name)  # a first registration, or a restart: an empty cache
        if info.role != worker.role:
            worker.problem = f"is a {info.role} instance, listed as {worker.role}"
        else:
            worker.problem = self.expected.problem(info, self.cache_dtype)
        if worker.problem:
            log.error("%s (%s) cannot serve: %s", worker.name, worker.address, worker.problem)
        else:
            self.cache_dtype = self.cache_dtype or info.cache_dtype
        worker.info = info

    def failed(self, worker: Worker) -> None:
        """A failed check or call; after `failures` in a row the worker is dropped."""
        worker.failures += 1
        if worker.failures >= self.max_failures and worker.healthy:
            log.warning("%s (%s) is down", worker.name, worker.address)
            worker.healthy = worker.routable = False
            worker.went_down.set()
            worker.info = None  # registered again when it comes back
            self.prefixes.drop(worker.name)
            self.on_update()

    async def _register_peers(self) -> None:
        """Tell every healthy decode instance the prefill instances it may pull from: the
        healthy ones. A prefill instance becomes routable once all of them know it."""
        decode = [w for w in self.of("decode") if w.healthy and not w.problem]
        prefill = [w for w in self.of("prefill") if w.healthy and not w.problem]
        peers = [w.address for w in prefill]
        request = pb.RegisterRequest(prefill_addresses=peers)
        results = await asyncio.gather(
            *(w.instance.Register(request, timeout=max(self.interval, 1.0)) for w in decode),
            return_exceptions=True,
        )
        for w, result in zip(decode, results, strict=True):
            w.routable = not isinstance(result, Exception)
            if not w.routable:
                self.failed(w)
        for w in prefill:  # every routable decode instance knows it now
            w.routable = True
        for w in self.workers:
            w.routable = w.routable and w.healthy and not w.problem

    # ------------------------------------------------------------ choosing an instance

    def pick_prefill(self, page_hashes: list[bytes], exclude: set[Worker]) -> PrefillChoice | None:
        """A routable prefill instance not in `exclude` for a request whose prompt's pages (all
        but its last token, which is always computed) have `page_hashes`; None when none is."""
        candidates = [w for w in self.of("prefill") if w.routable and w not in exclude]
        if not candidates:
            return None
        matched = [self.prefixes.match(w.name, page_hashes) for w in candidates]
        loads = [w.snapshot() for w in candidates]
        chosen, rule = balancer.pick_prefill(loads, matched, len(page_hashes), self.policy)
        return PrefillChoice(candidates[chosen], matched[chosen], rule)

    def prefilled(self, choice: PrefillChoice, leaves: list[bytes], cached_pages: int) -> None:
        """`choice.worker` prefilled a prompt: it found `cached_pages` of its pages cached and
        now caches every full page of it (`leaves`, whose first pages are those matched).
        Finding fewer than the index predicted, the index was wrong there: that page and what
        the instance evicted before it go first."""
        name = choice.worker.name
        if cached_pages < choice.cached_pages:
            self.prefixes.evicted(name, leaves[cached_pages])
        self.prefixes.insert(name, leaves)

    def pick_decode(self, exclude: set[Worker]) -> Worker | None:
        """A routable decode instance not in `exclude` with room; None when none has."""
        candidates = [w for w in self.of("decode") if w.routable and w not in exclude]
        chosen = balancer.pick_decode([w.snapshot() for w in candidates])
        return None if chosen is None else candidates[chosen]

    def server_info(self, serving: bool) -> pb.ServerInfo:
        infos = [
            pb.WorkerInfo(
                name=w.name, role=w.role, healthy=w.routable, load=w.load, problem=w.problem
            )
            for w in self.workers
        ]
        return pb.ServerInfo(workers=infos, serving=serving, problem=self.problem)
