"""The internal services of an instance: Prefill and KvTransfer (prefill role), Decode (decode
role). Both roles run one engine through an EngineLoop."""

from __future__ import annotations

import dataclasses
import queue

import grpc

from ref_server.engine import FinishReason, QueueFull
from ref_server.services.engine_loop import EngineLoop
from ref_server.services.kv_transfer import KvPuller, new_cache_id, shared_cache
from ref_server.services.messages import (
    FINISH,
    BadRequest,
    page_message,
    sampling_params,
)
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc


def _load(loop: EngineLoop) -> pb.WorkerLoad:
    return pb.WorkerLoad(**loop.call(lambda _: loop.load()))


def _wait(events: queue.Queue, context: grpc.ServicerContext):
    """The next event, without outliving the RPC's deadline."""
    remaining = context.time_remaining()
    try:
        return events.get(timeout=None if remaining is None else max(remaining, 0.0))
    except queue.Empty:
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded in the engine")


class PrefillService(rpc.PrefillServicer, rpc.KvTransferServicer):
    def __init__(self, loop: EngineLoop, max_tokens_limit: int) -> None:
        self.loop = loop
        self.max_tokens_limit = max_tokens_limit
        self.cache_id = new_cache_id()

    def Prefill(self, request, context):
        try:
            params = sampling_params(request.sampling, self.max_tokens_limit)
            first = dataclasses.replace(params, max_tokens=1)
            prompt = list(request.token_ids)
            seq, events = self.loop.open(
                request.request_id,
                lambda engine: engine.add(prompt, first, request.request_id, hold_pages=True),
            )
        except QueueFull as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except (BadRequest, ValueError) as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        context.add_callback(lambda: self.loop.cancel(request.request_id) or None)
        token, finish = None, None
        while finish is None:
            kind, value = _wait(events, context)
            if kind == "error":
                context.abort(grpc.StatusCode.INTERNAL, value)
            token, finish = (value, None) if kind == "token" else (token, value)
        if finish is FinishReason.ABORT:
            context.abort(grpc.StatusCode.CANCELLED, "aborted")
        self.loop.hold(request.request_id)
        if token in seq.eos_ids or token in params.stop_token_ids:
            request_finish = pb.FINISH_REASON_STOP
        elif params.max_tokens == 1:  # the request's own limit (the prefill always runs 1 token)
            request_finish = pb.FINISH_REASON_LENGTH
        else:
            request_finish = pb.FINISH_REASON_UNSPECIFIED  # decoding goes on
        pages = -(-seq.num_computed // self.loop.engine.scheduler.config.block_size)
        return pb.PrefillResponse(
            first_token=token,
            cached_tokens=seq.num_cached,
            kv_handle=request.request_id,
            num_pages=pages,
            finish_reason=request_finish,
        )

    def GetLoad(self, request, context):
        return _load(self.loop)

    def PrefixMatch(self, request, context):
        cached = self.loop.engine.scheduler.blocks.lookup(list(request.page_hashes))
        return pb.PrefixMatchResponse(cached_pages=len(cached))

    def _held(self, read, kv_handle: str, context):
        """read(engine) for a held request's KV; NOT_FOUND when none is held."""
        try:
            return self.loop.call(read)
        except KeyError:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no KV held under {kv_handle!r}")

    def Pull(self, request, context):
        pages = self._held(lambda e: e.pages(request.kv_handle), request.kv_handle, context)
        for index, page in enumerate(pages):
            yield page_message(index, page)

    def Locate(self, request, context):
        blocks = self._held(lambda e: e.held_blocks(request.kv_handle), request.kv_handle, context)
        return pb.KvBlocks(cache_id=self.cache_id, blocks=blocks)

    def ShareCache(self, request, context):
        return shared_cache(self.loop.engine.runner.cache, self.cache_id)

    def Release(self, request, context):
        self.loop.call(lambda engine: engine.release(request.kv_handle))
        return pb.ReleaseResponse()


class DecodeService(rpc.DecodeServicer):
    def __init__(self, loop: EngineLoop, max_tokens_limit: int) -> None:
        self.loop = loop
        self.max_tokens_limit = max_tokens_limit
        args, config = loop.engine.model.args, loop.engine.scheduler.config
        page_shape = (args.num_hidden_layers, config.block_size, args.cache_width)
        self.kv = KvPuller(page_shape, loop.engine.runner.device)

    def Decode(self, request, context):
        try:
            params = sampling_params(request.sampling, self.max_tokens_limit)
        except BadRequest as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        try:
            pages, method = self.kv.pull(request.prefill_address, request.kv_handle)
        except grpc.RpcError as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {error.details()}")
        prompt = list(request.token_ids)
        try:
            _, events = self.loop.open(
                request.request_id,
                lambda engine: engine.add_prefilled(
                    prompt, request.first_token, params, request.request_id, pages
                ),
            )
        except QueueFull as error:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        context.add_callback(lambda: self.loop.cancel(request.request_id) or None)
        yield pb.DecodeResponse(kv_transfer=method)
        while True:
            kind, value = _wait(events, context)
            if kind == "error":
                context.abort(grpc.StatusCode.INTERNAL, value)
            if kind == "token":
                yield pb.DecodeResponse(token_ids=[value])
            else:
                yield pb.DecodeResponse(finish_reason=FINISH[value])
                return

    def Abort(self, request, context):
        if not self.loop.cancel(request.request_id):
            context.abort(grpc.StatusCode.NOT_FOUND, f"{request.request_id!r} is not decoding here")
        return pb.AbortResponse()

    def GetLoad(self, request, context):
        return _load(self.loop)
