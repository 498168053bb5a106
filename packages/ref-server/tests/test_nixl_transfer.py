"""KV pages through NIXL (UCX) between two processes on the CPU: `NixlCache`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import ref_server.model as M
from ref_server.services.kv_transfer import TransferError

pytest.importorskip("nixl")  # in the test group; an instance without it says so (see below)

from ref_server.services.nixl_transfer import NixlCache, NixlUnavailable, Pages

ARGS = M.PRESETS["tiny"]
BLOCKS = 8


def cache(seed: int | None) -> M.PagedKVCache:
    kv = M.PagedKVCache(ARGS, BLOCKS, 16)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for layer in kv.layers:
            layer.copy_(torch.randn(layer.shape, generator=g).to(layer.dtype))
    return kv


PEER = Path(__file__).with_name("nixl_peer.py")


@pytest.fixture
def prefill(tmp_path):
    """A prefill process holding blocks 3, 1, 5 for us: (its metadata, pages, values, process)."""
    out = tmp_path / "peer.pt"
    process = subprocess.Popen(
        [sys.executable, str(PEER), str(out), "3,1,5"], stdin=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not out.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the prefill process did not start (exit {process.poll()})")
            time.sleep(0.05)
        metadata, kind, rows, values = torch.load(out)
        yield metadata, Pages(kind, rows), values, process
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def test_a_decode_process_reads_the_leased_pages_into_its_reserved_blocks(prefill):
    metadata, pages, values, _ = prefill
    reader = NixlCache(cache(seed=None))
    peer = reader.connect(metadata)
    assert reader.connect(metadata) == peer  # metadata is added once per pair
    moved = reader.read(peer, pages, [0, 2, 4], timeout=30.0)
    page_bytes = 16 * ARGS.cache_width * 2
    assert moved == 3 * ARGS.num_hidden_layers * page_bytes
    for mine, theirs in zip(reader.cache.layers, values, strict=True):
        assert torch.equal(mine[[0, 2, 4]], theirs)
        assert not mine[[1, 3, 5, 6, 7]].any()  # nothing else was written
    reader.close()


def test_a_read_that_does_not_match_the_reserved_pages_is_refused(prefill):
    metadata, pages, _, _ = prefill
    reader = NixlCache(cache(seed=None))
    peer = reader.connect(metadata)
    with pytest.raises(TransferError, match="the peer offers 9 pages, 2 blocks x 3 layers"):
        reader.read(peer, pages, [0, 2], timeout=30.0)
    with pytest.raises(TransferError, match="no NIXL connection to 'elsewhere'"):
        reader.read("elsewhere", pages, [0, 2, 4], timeout=30.0)
    assert not any(layer.any() for layer in reader.cache.layers)
    reader.close()


def test_a_read_from_a_dead_peer_fails_with_a_transfer_error(prefill):
    metadata, pages, _, process = prefill
    reader = NixlCache(cache(seed=None))
    peer = reader.connect(metadata)
    process.kill()
    process.wait(timeout=30)
    with pytest.raises(TransferError, match=r"NIXL read of 9 pages from .* (failed|outlasted 2 s)"):
        reader.read(peer, pages, [0, 2, 4], timeout=2.0)
    reader.close()


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        (Pages("HBM", b"\0" * 24), "memory kind must be one of"),
        (Pages("DRAM", b"\0" * 23), "whole \\(address, bytes, device\\) triples"),
        (Pages("DRAM", np.array([[1, 0, 0]], dtype="<i8").tobytes()), "non-zero sizes"),
        (Pages("DRAM", np.array([[-1, 8, 0]], dtype="<i8").tobytes()), "non-negative"),
    ],
)
def test_bad_page_descriptors_are_refused_before_any_transfer(pages, message):
    with pytest.raises(ValueError, match=message):
        pages.descriptors()


def test_the_pages_of_a_cache_name_every_layer_of_each_block_in_order():
    kv = cache(seed=None)
    source = NixlCache(kv)
    rows = np.frombuffer(source.pages([2, 0]).rows, dtype="<i8").reshape(-1, 3)
    want = [(layer[b].data_ptr(), layer[b].numel() * 2, 0) for layer in kv.layers for b in (2, 0)]
    assert [tuple(r) for r in rows.tolist()] == want
    with pytest.raises(ValueError, match=r"blocks must be a non-empty list in \[0, 8\)"):
        source.pages([8])  # the padding block is no sequence's
    source.close()


def test_without_nixl_the_agent_says_how_to_get_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_nixl(name, *args, **kwargs):
        if name.startswith("nixl"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nixl)
    with pytest.raises(NixlUnavailable, match=r"nixl is not installed .*: pip install nixl"):
        NixlCache(cache(seed=None))
