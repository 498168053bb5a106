"""The public Router service: validation, the prefill and decode balancers, streaming.

A request goes to the prefill instance that already caches the longest prefix of its prompt
(then the one with the fewest queued prompt tokens), which computes its KV and first token; then
to the decode instance with the lowest KV use (then the fewest running requests), which pulls
the KV and streams the rest. A worker that fails a call is marked unhealthy and skipped until
its health service answers SERVING again.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ref_server.engine import prefix_hashes
from ref_server.model import SamplingParams
from ref_server.services.messages import BadRequest, sampling_params
from ref_server.services.metrics import Metrics
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

WORKER_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)

TRANSFER_LABELS = {pb.KV_TRANSFER_METHOD_GRPC: "grpc", pb.KV_TRANSFER_METHOD_CUDA_IPC: "cuda_ipc"}


@dataclass
class Worker:
    role: str
    address: str
    channel: grpc.Channel = field(init=False)
    healthy: bool = True
    assigned: int = 0  # requests this router has in flight there (loads lag behind)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.address)
        stub = rpc.PrefillStub if self.role == "prefill" else rpc.DecodeStub
        self.stub = stub(self.channel)
        self.kv = rpc.KvTransferStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)


@dataclass
class InFlight:
    """A request between admission and its last message."""

    call: grpc.Future | None = None  # its decode call, once started
    aborted: bool = False


@dataclass
class _Job:
    """One Generate call on its way through the router."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    sampling: pb.SamplingParams
    context: grpc.ServicerContext
    entry: InFlight
    stream: _Stream


@dataclass
class ModelFacts:
    name: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_parameters: int
    eos_token_ids: list[int]
    page_size: int
    page_bytes: int


class RouterService(rpc.RouterServicer):
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        model: ModelFacts,
        tokenizer,
        metrics: Metrics,
        max_request_bytes: int = 1 << 20,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode address")
        self.workers = [Worker("prefill", a) for a in prefill]
        self.workers += [Worker("decode", a) for a in decode]
        self.model = model
        self.max_request_bytes = max_request_bytes
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.inflight: dict[str, InFlight] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        threading.Thread(target=self._watch, name="router-health", daemon=True).start()

    # ------------------------------------------------------------ balancers

    def _healthy(self, role: str) -> list[Worker]:
        found = [w for w in self.workers if w.role == role and w.healthy]
        if not found:
            raise LookupError(f"no healthy {role} instance")
        return found

    def _load(self, worker: Worker) -> pb.WorkerLoad:
        return worker.stub.GetLoad(pb.GetLoadRequest(), timeout=2)

    def pick_prefill(self, prompt: list[int]) -> Worker:
        """The prefill instance caching the longest prefix of `prompt`, then the one with the
        least prefill work queued (matmuls and attention, in FLOPs); its `assigned` count
        already includes this request."""
        hashes = prefix_hashes(prompt[:-1], self.model.page_size)
        candidates = []
        for worker in self._healthy("prefill"):
            try:
                match = pb.PrefixMatchRequest(page_hashes=hashes)
                cached = worker.stub.PrefixMatch(match, timeout=2).cached_pages
                candidates.append((worker, cached, self._load(worker)))
            except grpc.RpcError:
                self._down(worker)
        if not candidates:
            raise LookupError("no healthy prefill instance")
        with self.lock:  # concurrent picks see each other's choices
            worker, _, _ = min(
                candidates, key=lambda c: (-c[1], c[2].queued_flops, c[0].assigned, c[2].running)
            )
            worker.assigned += 1
        return worker

    def pick_decode(self) -> Worker:
        """The decode instance for a request; its `assigned` count already includes it."""
        loads = []
        for worker in self._healthy("decode"):
            try:
                loads.append((worker, self._load(worker)))
            except grpc.RpcError:
                self._down(worker)
        if not loads:
            raise LookupError("no healthy decode instance")
        with self.lock:  # concurrent picks see each other's choices
            worker, _ = min(
                loads, key=lambda w: (w[1].kv_usage, w[0].assigned, w[1].running + w[1].waiting)
            )
            worker.assigned += 1
        return worker

    def _worker_error(self, worker: Worker, error: grpc.RpcError) -> grpc.StatusCode:
        """A failed call to a worker: the code for the client; a worker down is marked so."""
        if error.code() in WORKER_DOWN:
            self._down(worker)
            return grpc.StatusCode.UNAVAILABLE
        return error.code()

    def _down(self, worker: Worker) -> None:
        worker.healthy = False
        self.metrics.healthy.labels(worker.address).set(0)

    def _watch(self) -> None:
        """Every second: worker health (down ones come back when SERVING) and load gauges."""
        while not self.stop.wait(1.0):
            for worker in self.workers:
                try:
                    status = worker.health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    worker.healthy = status == health_pb2.HealthCheckResponse.SERVING
                    load = self._load(worker) if worker.healthy else None
                except grpc.RpcError:
                    worker.healthy, load = False, None
                self.metrics.healthy.labels(worker.address).set(int(worker.healthy))
                if load is not None:
                    self.metrics.waiting.labels(worker.address).set(load.waiting)
                    self.metrics.running.labels(worker.address).set(load.running)
                    self.metrics.kv_usage.labels(worker.address).set(load.kv_usage)

    # ------------------------------------------------------------ the API

    def _prompt(self, request) -> list[int]:
        kind = request.WhichOneof("input")
        if kind is None:
            raise BadRequest("the request has neither text nor token_ids")
        prompt = (
            self.tokenizer.encode(request.text) if kind == "text" else list(request.token_ids.ids)
        )
        if not prompt:
            raise BadRequest("empty prompt")
        bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} outside [0, {self.model.vocab_size})")
        return prompt

    def Generate(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        try:
            if request.ByteSize() > self.max_request_bytes:
                raise BadRequest(
                    f"request of {request.ByteSize()} bytes is over the limit of "
                    f"{self.max_request_bytes}"
                )
            prompt = self._prompt(request)
            params = sampling_params(request.sampling, self.model.max_model_len)
            if len(prompt) + params.max_tokens > self.model.max_model_len:
                raise BadRequest(
                    f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds "
                    f"the context limit of {self.model.max_model_len}"
                )
        except BadRequest as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        with self.lock:
            if request_id in self.inflight:
                message = f"request id {request_id!r} is in flight"
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            entry = self.inflight[request_id] = InFlight()
        stream = _Stream(self.tokenizer, request.sampling.stop)
        job = _Job(request_id, prompt, params, request.sampling, context, entry, stream)
        try:
            yield from self._run(job)
        finally:
            with self.lock:
                self.inflight.pop(request_id, None)

    def _run(self, job: _Job):
        start = time.monotonic()
        prefilled = yield from self._prefill(job)
        if prefilled is None:
            return
        prefill, first = prefilled
        self.metrics.ttft.observe(time.monotonic() - start)
        finish = pb.FINISH_REASON_STOP if job.stream.stopped else None
        if job.entry.aborted:
            finish = pb.FINISH_REASON_ABORT
        if first.finish_reason or finish is not None:
            prefill.kv.Release(pb.ReleaseRequest(kv_handle=first.kv_handle), timeout=5)
            finish = finish or first.finish_reason
        else:
            finish = yield from self._decode(job, prefill, first)
            if finish is None:
                return
        if len(job.stream.tokens) > 1:
            self.metrics.tpot.observe((time.monotonic() - start) / len(job.stream.tokens))
        self.metrics.requests.labels("ok").inc()
        usage = pb.Usage(
            prompt_tokens=len(job.prompt),
            completion_tokens=len(job.stream.tokens),
            cached_tokens=first.cached_tokens,
        )
        complete = pb.Complete(finish_reason=finish, usage=usage)
        yield pb.GenerateResponse(request_id=job.request_id, complete=complete)

    def _prefill(self, job: _Job):
        """The prefill call; yields the first token's chunk. Returns (instance, response), or
        None once a failure is reported."""
        try:
            prefill = self.pick_prefill(job.prompt)
            try:
                message = pb.PrefillRequest(
                    request_id=job.request_id, token_ids=job.prompt, sampling=job.sampling
                )
                first = prefill.stub.Prefill(message, timeout=job.context.time_remaining())
            finally:
                prefill.assigned -= 1
        except LookupError as error:
            yield from self._fail(job, grpc.StatusCode.UNAVAILABLE, str(error))
            return None
        except grpc.RpcError as error:
            code = self._worker_error(prefill, error)
            yield from self._fail(job, code, f"prefill failed: {error.details()}")
            return None
        self.metrics.prompt_tokens.inc(len(job.prompt))
        self.metrics.cached_tokens.inc(first.cached_tokens)
        yield self._chunk(job, [first.first_token])
        return prefill, first

    def _decode(self, job: _Job, prefill: Worker, first: pb.PrefillResponse):
        """The decode call; yields its tokens' chunks. Returns the finish reason, or None once
        a failure is reported."""
        try:
            decode = self.pick_decode()
        except LookupError as error:
            prefill.kv.Release(pb.ReleaseRequest(kv_handle=first.kv_handle), timeout=5)
            yield from self._fail(job, grpc.StatusCode.UNAVAILABLE, str(error))
            return None
        finish = None
        try:
            message = pb.DecodeRequest(
                request_id=job.request_id,
                token_ids=job.prompt,
                first_token=first.first_token,
                sampling=job.sampling,
                prefill_address=prefill.address,
                kv_handle=first.kv_handle,
            )
            call = decode.stub.Decode(message, timeout=job.context.time_remaining())
            with self.lock:
                job.entry.call = call
                if job.entry.aborted:  # an Abort that came while the decode call started
                    call.cancel()
            job.context.add_callback(call.cancel)
            for message in call:
                if message.kv_transfer:
                    method = TRANSFER_LABELS[message.kv_transfer]
                    self.metrics.transfer_bytes.labels(method).inc(
                        first.num_pages * self.model.page_bytes
                    )
                if message.token_ids:
                    yield self._chunk(job, list(message.token_ids))
                    if job.stream.stopped:
                        call.cancel()
                        return pb.FINISH_REASON_STOP
                if message.finish_reason:
                    finish = message.finish_reason
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED and finish is None:
                return pb.FINISH_REASON_ABORT  # Abort, or the client went away
            if finish is None:
                code = self._worker_error(decode, error)
                yield from self._fail(job, code, f"decode failed: {error.details()}")
                return None
        finally:
            decode.assigned -= 1
        return finish

    def _fail(self, job: _Job, code: grpc.StatusCode, message: str):
        self.metrics.requests.labels(code.name.lower()).inc()
        error = pb.Error(code=code.value[0], message=message)
        yield pb.GenerateResponse(request_id=job.request_id, error=error)
        job.context.abort(code, message)

    def _chunk(self, job: _Job, tokens: list[int]) -> pb.GenerateResponse:
        self.metrics.count_output(len(tokens))
        chunk = pb.Chunk(token_ids=tokens, text=job.stream.add(tokens))
        return pb.GenerateResponse(request_id=job.request_id, chunk=chunk)

    def Abort(self, request, context):
        with self.lock:
            entry = self.inflight.get(request.request_id)
            if entry is not None:
                entry.aborted = True
                if entry.call is not None:
                    entry.call.cancel()
        if entry is None:
            message = f"unknown request id {request.request_id!r}"
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        return pb.AbortResponse()

    def GetModelInfo(self, request, context):
        m = self.model
        return pb.ModelInfo(
            name=m.name,
            vocab_size=m.vocab_size,
            max_model_len=m.max_model_len,
            num_layers=m.num_layers,
            num_parameters=m.num_parameters,
            eos_token_ids=m.eos_token_ids,
        )

    def GetServerInfo(self, request, context):
        infos = []
        for worker in self.workers:
            try:
                load = self._load(worker)
            except grpc.RpcError:
                load = None
            healthy = worker.healthy and load is not None
            info = pb.WorkerInfo(role=worker.role, address=worker.address, healthy=healthy)
            if load is not None:
                info.load.CopyFrom(load)
            infos.append(info)
        return pb.ServerInfo(workers=infos)


class _Stream:
    """The text of a completion as it grows, and whether it reached a stop string."""

    def __init__(self, tokenizer, stops) -> None:
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False

    def add(self, tokens: list[int]) -> str:
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens)
        new, self.text = text[len(self.text) :], text
        self.stopped = any(stop in text for stop in self.stops if stop)
        return new
