"""One side of a NIXL transfer as its own process (`test_nixl_transfer.py`: nixl cannot share
the test process with grpc_tools' protoc). Both sides hold a tiny-preset cache of 8 pages of 16.

    python nixl_peer.py prefill OUT BLOCKS   # random pages; saves (metadata, pages, values)
                                             # to OUT, then exits when stdin closes
    python nixl_peer.py decode IN OUT BLOCKS CASE
        # reads IN's pages into BLOCKS of a zeroed cache; saves what happened to OUT. CASE:
        # "read" (as told), "unknown-peer" (a name never connected) or "short" (one block less)
"""

import os
import sys

import torch

import ref_server.model as M
from ref_server.services.nixl_transfer import NixlCache, NixlError, Pages


def save(value, path: str) -> None:
    torch.save(value, path + ".part")
    os.replace(path + ".part", path)


def prefill(out: str, blocks: list[int]) -> None:
    cache = M.PagedKVCache(M.PRESETS["tiny"], 8, 16)
    g = torch.Generator().manual_seed(7)
    for layer in cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=g).to(layer.dtype))
    source = NixlCache(cache)
    pages = source.pages(blocks)
    save(
        (source.metadata(), pages.kind, pages.rows, [layer[blocks] for layer in cache.layers]), out
    )
    sys.stdin.read()
    source.close()


def decode(given: str, out: str, blocks: list[int], case: str) -> None:
    metadata, kind, rows, _ = torch.load(given)
    reader = NixlCache(M.PagedKVCache(M.PRESETS["tiny"], 8, 16))
    result = {}
    try:
        peer = reader.connect(metadata)
        result["same_peer_again"] = reader.connect(metadata) == peer
        result["peers"] = len(reader._peers)
        target = "elsewhere" if case == "unknown-peer" else peer
        asked = blocks[:-1] if case == "short" else blocks
        result["moved"] = reader.read(target, Pages(kind, rows), asked, 10.0)
    except NixlError as error:
        result["error"] = str(error)
    result["layers"] = [layer.clone() for layer in reader.cache.layers]
    save(result, out)
    reader.close()


if __name__ == "__main__":
    role, *rest = sys.argv[1:]
    if role == "prefill":
        prefill(rest[0], [int(b) for b in rest[1].split(",")])
    else:
        decode(rest[0], rest[1], [int(b) for b in rest[2].split(",")], rest[3])
