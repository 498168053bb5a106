"""KV pages on the wire: a page comes back as it went, and a damaged one is refused before any
of its values is used (no decode from incomplete or corrupted KV)."""

from __future__ import annotations

import pytest
import torch

from ref_server.services.messages import page_message, page_tensor

SHAPE = (3, 16, 576)  # layers, page size, cache width


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_a_page_comes_back_bit_for_bit(dtype):
    page = torch.randn(SHAPE).to(dtype)
    message = page_message(7, page, "handle")
    assert (message.index, message.kv_handle) == (7, "handle")
    back = page_tensor(message, SHAPE)
    assert back.dtype == dtype
    assert torch.equal(back.view(torch.uint8), page.view(torch.uint8))


def test_damaged_pages_are_refused():
    message = page_message(0, torch.randn(SHAPE).to(torch.bfloat16), "h")
    flipped = bytearray(message.data)
    flipped[100] ^= 1
    corrupted = type(message)()
    corrupted.CopyFrom(message)
    corrupted.data = bytes(flipped)
    with pytest.raises(ValueError, match="page 0 fails its checksum"):
        page_tensor(corrupted, SHAPE)
    with pytest.raises(ValueError, match="holds 55296 bytes, not"):
        page_tensor(message, (3, 32, 576))
    foreign = type(message)()
    foreign.CopyFrom(message)
    foreign.dtype = "complex128"
    with pytest.raises(ValueError, match="unknown dtype 'complex128'"):
        page_tensor(foreign, SHAPE)
