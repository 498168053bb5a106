"""A prefill instance's side of a NIXL transfer, as its own process (`test_nixl_transfer.py`):
its cache of random pages registered, then (metadata, pages, the pages' values) saved to the
file named by argv[1]; it exits when its stdin closes."""

import os
import sys

import torch

import ref_server.model as M
from ref_server.services.nixl_transfer import NixlCache

if __name__ == "__main__":
    path, blocks = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
    cache = M.PagedKVCache(M.PRESETS["tiny"], 8, 16)
    g = torch.Generator().manual_seed(7)
    for layer in cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=g).to(layer.dtype))
    source = NixlCache(cache)
    pages = source.pages(blocks)
    values = [layer[blocks].clone() for layer in cache.layers]
    torch.save((source.metadata(), pages.kind, pages.rows, values), path + ".part")
    os.replace(path + ".part", path)
    sys.stdin.read()
    source.close()
