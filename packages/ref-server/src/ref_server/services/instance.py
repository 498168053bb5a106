"""The internal services of an instance, on its asyncio gRPC server: Instance (both roles),
Prefill and KvTransfer (prefill role), Decode (decode role).

Handlers wait for the engine only through futures and queues, so a busy engine never delays
another call (a health check, a load report, a cancel). A cancelled call ends its request
wherever it is and frees its pages: the handler's `finally` queues the abort.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc

from ref_server.engine import FinishReason, QueueFull
from ref_server.services.aio import Events
from ref_server.services.engine_loop import EngineLoop
from ref_server.services.kv_transfer import KvPuller, TransferError, new_cache_id, shared_cache
from ref_server.services.messages import FINISH, BadRequest, page_message, sampling_params
from ref_server.services.nixl_transfer import NixlCache, NixlUnavailable
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

log = logging.getLogger(__name__)

PULL_PAGES = 4  # pages read from the cache at a time for a Pull stream


async def admit(loop: EngineLoop, request_id: str, add, events: Events, context):
    """add(engine) for a new request, its events to `events`; a refusal aborts the call. A
    call cancelled meanwhile still ends the request, should the engine have taken it."""
    try:
        return await asyncio.wrap_future(loop.open(request_id, add, events.put))
    except asyncio.CancelledError:
        loop.cancel(request_id)  # queued behind the admission: runs after it
        raise
    except QueueFull as error:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
    except ValueError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    except RuntimeError as error:  # the loop has failed
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))


async def parsed_sampling(request, limit: int, context):
    try:
        return sampling_params(request.sampling, limit)
    except BadRequest as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


class InstanceService(rpc.InstanceServicer):
    def __init__(self, loop: EngineLoop, info: pb.InstanceInfo, puller: KvPuller | None = None):
        self.loop, self.info, self.puller = loop, info, puller

    async def Register(self, request, context):
        if self.puller is not None:
            self.puller.set_peers(list(request.prefill_addresses))
        return self.info

    async def GetLoad(self, request, context):
        mapped = self.puller.num_mapped if self.puller else 0
        configured = self.info.ranks
        return pb.WorkerLoad(**self.loop.load, mapped_caches=mapped, configured_ranks=configured)


class PrefillService(rpc.PrefillServicer, rpc.KvTransferServicer):
    def __init__(self, loop: EngineLoop, max_tokens_limit: int) -> None:
        self.loop = loop
        self.max_tokens_limit = max_tokens_limit
        self.cache_id = new_cache_id()
        self.nixl: NixlCache | None = None  # made when a decode instance first asks
        self.nixl_unavailable: str | None = None

    def _nixl(self) -> NixlCache | None:
        """The NIXL agent that has this instance's cache registered (started on first use), or
        None, and why in nixl_unavailable."""
        if self.nixl is None and self.nixl_unavailable is None:
            try:
                self.nixl = NixlCache(self.loop.engine.runner.cache)
            except NixlUnavailable as error:
                self.nixl_unavailable = str(error)
                log.warning("no NIXL KV transfer from this instance: %s", error)
        return self.nixl

    async def Prefill(self, request, context):
        params = await parsed_sampling(request, self.max_tokens_limit, context)
        first = dataclasses.replace(params, max_tokens=1)
        prompt, request_id, salt = list(request.token_ids), request.request_id, request.cache_salt

        def add(engine):
            return engine.add(prompt, first, request_id, hold_pages=True, cache_salt=salt)

        events = Events()
        seq = await admit(self.loop, request_id, add, events, context)
        token, finish, done = None, None, False
        try:
            while finish is None:
                kind, value = await events.get()
                if kind == "error":
                    await context.abort(grpc.StatusCode.INTERNAL, value)
                token, finish = (value, None) if kind == "token" else (token, value)
            if finish is FinishReason.ABORT:
                await context.abort(grpc.StatusCode.ABORTED, "the request was aborted")
            done = True
        finally:
            if not done:  # cancelled or failed: nothing may stay held
                self.loop.cancel(request_id)
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
            kv_handle=request_id,
            num_pages=pages,
            finish_reason=request_finish,
            lease_seconds=self.loop.hold_seconds,
        )

    async def PrefixMatch(self, request, context):
        hashes = list(request.page_hashes)
        lookup = self.loop.submit(lambda engine: len(engine.scheduler.blocks.lookup(hashes)))
        return pb.PrefixMatchResponse(cached_pages=await asyncio.wrap_future(lookup))

    async def _held(self, kv_handle: str, read, context):
        """read(engine) for a held request's KV, renewing its lease; NOT_FOUND when none."""
        try:
            return await asyncio.wrap_future(self.loop.extend(kv_handle, read))
        except KeyError:
            message = f"no KV held under {kv_handle!r} (its lease ran out, or it was released)"
            await context.abort(grpc.StatusCode.NOT_FOUND, message)

    async def Pull(self, request, context):
        """The pages a few at a time: each few read on the engine's thread (renewing the
        lease) and encoded on a worker thread while the few before are being sent."""
        handle = request.kv_handle
        count = await self._held(handle, lambda engine: len(engine.held_blocks(handle)), context)

        async def encoded(start: int) -> list[pb.KvPage]:
            stop = start + PULL_PAGES
            pages = await self._held(
                handle, lambda engine: engine.pages(handle, start, stop), context
            )
            return await asyncio.to_thread(
                lambda: [page_message(start + i, page, handle) for i, page in enumerate(pages)]
            )

        upcoming = asyncio.ensure_future(encoded(0)) if count else None
        try:
            for start in range(0, count, PULL_PAGES):
                messages = await upcoming
                following = start + PULL_PAGES
                upcoming = asyncio.ensure_future(encoded(following)) if following < count else None
                for message in messages:
                    yield message
        finally:
            if upcoming is not None:  # the stream ended early: cancelled, or a send failed
                upcoming.cancel()

    async def Locate(self, request, context):
        handle = request.kv_handle
        blocks = await self._held(handle, lambda engine: engine.held_blocks(handle), context)
        located = pb.KvBlocks(
            cache_id=self.cache_id, blocks=blocks, lease_seconds=self.loop.hold_seconds
        )
        if request.nixl_pages and blocks and self.nixl is not None:
            pages = self.nixl.pages(list(blocks))
            located.nixl_pages.kind, located.nixl_pages.rows = pages.kind, pages.rows
        return located

    async def ShareCache(self, request, context):
        shared = shared_cache(self.loop.engine.runner.cache, self.cache_id)
        if request.nixl:
            if (nixl := self._nixl()) is not None:
                shared.nixl_metadata = nixl.metadata()
            else:
                shared.nixl_unavailable = self.nixl_unavailable
        return shared

    async def Release(self, request, context):
        if not await asyncio.wrap_future(self.loop.release(request.kv_handle)):
            message = (
                f"no KV held under {request.kv_handle!r} (its lease ran out, or it was released)"
            )
            await context.abort(grpc.StatusCode.NOT_FOUND, message)
        return pb.ReleaseResponse()


class DecodeService(rpc.DecodeServicer):
    def __init__(self, loop: EngineLoop, max_tokens_limit: int, puller: KvPuller) -> None:
        self.loop = loop
        self.max_tokens_limit = max_tokens_limit
        self.puller = puller

    async def Decode(self, request, context):
        params = await parsed_sampling(request, self.max_tokens_limit, context)
        if request.prefill_address not in self.puller.peers:
            message = f"{request.prefill_address!r} is not a registered prefill instance"
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
        prompt, request_id = list(request.token_ids), request.request_id

        def reserve(engine):
            first, salt = request.first_token, request.cache_salt
            return engine.reserve(prompt, first, params, request_id, salt)

        events = Events()
        targets = await admit(self.loop, request_id, reserve, events, context)
        finished = False
        try:
            method = await self._pull(request, targets, context)
            try:
                await asyncio.wrap_future(self.loop.start(request_id))
            except KeyError:  # the engine ended it meanwhile (a failed step): its error says why
                _, why = await events.get()
                await context.abort(grpc.StatusCode.INTERNAL, why)
            yield pb.DecodeResponse(kv_transfer=method)
            while not finished:
                batch = await events.batch()
                ends = [(kind, value) for kind, value in batch if kind != "token"]
                if ends and ends[0][0] == "error":
                    await context.abort(grpc.StatusCode.INTERNAL, ends[0][1])
                finished = bool(ends)
                yield pb.DecodeResponse(
                    token_ids=[value for kind, value in batch if kind == "token"],
                    finish_reason=FINISH[ends[0][1]] if ends else pb.FINISH_REASON_UNSPECIFIED,
                )
        finally:
            if not finished:  # cancelled or failed: free the reserved or running pages
                self.loop.cancel(request_id)

    async def _pull(self, request, targets, context) -> int:
        """The KV into the reserved pages. Cancelled, it still waits for the copy to end:
        the pages must not be freed under it."""
        pull = asyncio.ensure_future(
            self.puller.pull(request.prefill_address, request.kv_handle, targets, request.num_pages)
        )
        try:
            return await asyncio.shield(pull)
        except asyncio.CancelledError:
            await asyncio.wait([pull])
            if not pull.cancelled():
                pull.exception()  # seen: the request is gone, whatever the copy did
            raise
        except TransferError as error:
            log.warning("KV transfer for %s failed: %s", request.request_id, error)
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {error}")
