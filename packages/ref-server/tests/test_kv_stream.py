"""KvPuller's gRPC stream against a KvTransfer server of this test's own (real gRPC on loopback),
which sends pages as a prefill instance does, or damages one of them; for V3's tiny model,
V3.2's, whose pages carry the indexer's keys and scales beside the latent rows, and V3's with
its MTP module, whose pages carry the module's rows and a prompt's last hidden state. Pages
that do not fit the decode instance's cache are refused by every method."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch

import ref_server.model as M
from ref_server.engine import Engine, SchedulerConfig
from ref_server.services.kv_transfer import (
    GRPC,
    STREAM_WRITE_PAGES,
    KvPuller,
    TransferError,
    nixl_targets,
)
from ref_server.services.messages import page_message
from ref_server.services.nixl_transfer import cache_pages
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

PAGES = 2 * STREAM_WRITE_PAGES + 1  # two whole batches and one page
PRESETS = ["tiny", "v3.2-tiny", "tiny+mtp"]


def args_of(preset: str) -> M.ModelArgs:
    """A preset's args; "+mtp": with the MTP module."""
    args = M.PRESETS[preset.removesuffix("+mtp")]
    return dataclasses.replace(args, num_nextn_predict_layers=int(preset.endswith("+mtp")))


class Pages(rpc.KvTransferServicer):
    """Random pages of the preset's cache (pages of 16) under handle "h"; `damaged`: the index
    whose checksum is wrong; `sent`: how many pages the stream carries before it ends (all by
    default)."""

    def __init__(
        self, preset: str, damaged: int | None = None, sent: int = PAGES, pause: float = 0.0
    ) -> None:
        size = M.cache_page_bytes(args_of(preset), 16)
        self.pages = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(PAGES)]
        self.damaged, self.sent, self.pause = damaged, sent, pause
        self.released = 0
        self.pulled: list[str] = []  # how each Pull ended: "sent" or "cancelled"

    async def Pull(self, request, context):
        try:
            for index, page in enumerate(self.pages[: self.sent]):
                message = page_message(index, page, request.kv_handle)
                if index == self.damaged:
                    message.crc32 ^= 1
                yield message
                await asyncio.sleep(self.pause)
        except asyncio.CancelledError:
            self.pulled.append("cancelled")
            raise
        self.pulled.append("sent")

    async def Release(self, request, context):
        self.released += 1
        return pb.ReleaseResponse()


def pull(server: Pages, preset: str) -> tuple[Engine, int | Exception]:
    """The server's pages pulled into blocks 20.. of a fresh engine's cache of the preset:
    (engine, the method or the error)."""
    model = M.from_args(args_of(preset))
    engine = Engine(model, SchedulerConfig(num_blocks=64, block_size=16, max_model_len=512))

    async def run():
        listener = grpc.aio.server()
        rpc.add_KvTransferServicer_to_server(server, listener)
        port = listener.add_insecure_port("127.0.0.1:0")
        await listener.start()
        puller = KvPuller(engine.runner, "stream-test", "grpc")
        address = f"127.0.0.1:{port}"
        puller.set_peers([address])
        try:
            return await puller.pull(address, "h", [(i, 20 + i) for i in range(PAGES)], PAGES)
        except TransferError as error:
            return error
        finally:
            for _ in range(100):  # the server's Pull ends: sent, or cancelled by the puller
                if server.pulled:
                    break
                await asyncio.sleep(0.05)
            await listener.stop(None)

    return engine, asyncio.run(run())


@pytest.mark.parametrize("preset", PRESETS)
def test_streamed_pages_land_in_their_blocks_in_batches(preset):
    server = Pages(preset)
    engine, method = pull(server, preset)
    assert method == GRPC and server.released == 1
    for index, page in enumerate(server.pages):
        assert torch.equal(engine.runner.read_page(20 + index), page), index
    empty = M.PagedKVCache(args_of(preset), 1, 16).read_page(0)
    assert torch.equal(engine.runner.read_page(20 + PAGES), empty)
    cache, block, page = engine.runner.cache, 20 + PAGES - 1, server.pages[-1]
    assert torch.equal(cache.layers[0][block].flatten().view(torch.uint8), page[: 16 * 1152])
    if args_of(preset).is_sparse:  # then every layer's index keys, then their scales
        scales = cache.index_keys[-1].scales[block]
        assert torch.equal(scales.view(torch.uint8), page[-16 * 4 :])
    if preset.endswith("+mtp"):  # the module's rows after the model's, then the hidden state
        rows = 16 * 1152
        assert torch.equal(
            cache.layers[-1][block].flatten().view(torch.uint8), page[-rows - 256 : -256]
        )
        assert torch.equal(cache.prompt_hidden[block].view(torch.uint8), page[-256:])


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("damaged", [1, STREAM_WRITE_PAGES + 1, PAGES - 1])
def test_a_damaged_page_fails_the_pull_after_every_write_ended(damaged, preset):
    """A page that fails its checksum in the first, a middle or the last batch: the pull is a
    TransferError naming it, the lease is released, and when it returns the pages before it in
    its batch are written and none after it: no write is still running."""
    server = Pages(preset, damaged)
    empty = M.PagedKVCache(args_of(preset), 1, 16).read_page(0)
    engine, error = pull(server, preset)
    assert isinstance(error, TransferError) and f"page {damaged} fails its checksum" in str(error)
    assert server.released == 1
    first_of_batch = damaged - damaged % STREAM_WRITE_PAGES
    for index in range(first_of_batch, PAGES):
        written = engine.runner.read_page(20 + index)
        if index < damaged:
            assert torch.equal(written, server.pages[index]), index
        else:
            assert torch.equal(written, empty), index


def test_a_damaged_page_cancels_the_rest_of_the_stream():
    """The puller stops the prefill side's stream at the bad page (pages 0.1 s apart: the rest
    would take 1.5 s more), not when the call is collected."""
    server = Pages("tiny", damaged=1, pause=0.1)
    _, error = pull(server, "tiny")
    assert isinstance(error, TransferError) and server.pulled == ["cancelled"]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_stream_that_ends_short_fails_after_the_writes_in_flight_ended(preset):
    """The stream ends one page early, while the batch before is being written: the pull
    fails naming the count, and when it returns that batch is whole in the cache."""
    server = Pages(preset, sent=PAGES - 1)
    engine, error = pull(server, preset)
    assert isinstance(error, TransferError)
    assert f"{PAGES - 1} pages came, {PAGES} were prefilled" in str(error)
    assert server.released == 1
    for index in range(PAGES - 1):
        assert torch.equal(engine.runner.read_page(20 + index), server.pages[index]), index


def test_a_page_of_another_size_is_refused_before_any_write():
    cache = M.PagedKVCache(M.PRESETS["v3.2-tiny"], 2, 16)
    page = torch.randint(0, 256, (cache.page_bytes,), dtype=torch.uint8)
    cache.write_page(1, page)
    assert torch.equal(cache.read_page(1), page)
    with pytest.raises(ValueError, match=rf"a page is \[{cache.page_bytes}\] uint8, got \(1152,\)"):
        cache.write_page(0, page[:1152])
    assert not cache.layers[0][0].any()


@pytest.mark.parametrize(("sent", "here"), [("tiny", "tiny+mtp"), ("tiny+mtp", "tiny")])
def test_pages_that_do_not_fit_are_refused_by_every_method_saying_what_a_page_holds(sent, here):
    """A prefill instance without the MTP module hands a decode instance with it pages without
    the prompt's last hidden state (and the module's rows), or the other way round: the
    stream, a CUDA IPC copy and a NIXL read each refuse them before writing anything, saying
    what a page holds here."""
    cache = M.PagedKVCache(args_of(here), 64, 16)
    holds = "this instance's " + cache.page_contents
    if here.endswith("+mtp"):
        assert holds.endswith(
            "4 layers' latent rows (the MTP module's last), the 64 float32 values of a "
            "prompt's last hidden state, which the MTP module's first draft reads"
        )
    server = Pages(sent)
    engine, error = pull(server, here)
    assert isinstance(error, TransferError) and holds in str(error)
    assert f"page 0 holds {server.pages[0].numel()} bytes, not {holds}" in str(error)
    assert server.released == 1
    assert not any(t.any() for t in engine.runner.cache.page_tensors)

    theirs = M.PagedKVCache(args_of(sent), 8, 16)
    puller = KvPuller(engine.runner, "stream-test", "cuda_ipc")
    with pytest.raises(ValueError, match="the prefill instance's pages hold") as refused:
        puller._copy_blocks(theirs.page_tensors, [1], [20])
    assert holds in str(refused.value)
    located = pb.KvBlocks(blocks=[3, 1], nixl_pages=pb.NixlPages(kind="DRAM"))
    located.nixl_pages.rows = cache_pages(theirs, [3, 1]).rows
    with pytest.raises(ValueError, match="the prefill instance's pages hold") as refused:
        nixl_targets(engine.runner.cache, located, [(1, 20)], 2)
    assert holds in str(refused.value)
    assert not any(t.any() for t in engine.runner.cache.page_tensors)
