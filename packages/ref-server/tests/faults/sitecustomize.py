"""Faults and hooks for the tests, in processes they start (a deployment's): Python imports this
module at startup when this folder leads PYTHONPATH. With FAIL_NIXL_READS=N in the environment,
the process's first N NIXL reads fail midway, as a link that goes down would: the first half of
the request's pages are read for real, then the read raises TransferError. With DRAFTS=FILE (a
JSON object, position: token), speculative decoding drafts by `draft_oracle` instead of the MTP
module (random weights draft almost nothing right). The tests' own process takes `draft_oracle`
from here too (conftest's `oracle`)."""

import json
import os

FAIL_NIXL_READS = "REF_SERVER_TEST_FAIL_NIXL_READS"
DRAFTS = "REF_SERVER_TEST_DRAFTS"


def draft_oracle(want: dict[int, int], wrong_every: int):
    """A `propose` that drafts the reference's token at each position (positions of the
    prompts' continuations must not overlap), but a wrong one where position % wrong_every is
    0: runs of accepted drafts, each ended by a rejection."""

    def propose(logits, params, positions):
        import torch

        vocab = logits.shape[1]
        tokens = [
            (want.get(at, 0) + 1) % vocab if at % wrong_every == 0 else want.get(at, 0)
            for at in positions
        ]
        return torch.tensor(tokens, dtype=torch.int64, device=logits.device), [None] * len(tokens)

    return propose


if drafts := os.environ.get(DRAFTS):
    import ref_server.model.speculative as speculative

    with open(drafts) as file:
        speculative.propose = draft_oracle(
            {int(p): t for p, t in json.load(file).items()}, wrong_every=5
        )

if failures := int(os.environ.get(FAIL_NIXL_READS, "0")):
    import numpy as np

    from ref_server.services.kv_transfer import TransferError
    from ref_server.services.nixl_transfer import NixlCache, Pages

    read = NixlCache.read

    def read_half_then_fail(self, peer, pages, blocks, timeout):
        global failures
        if failures <= 0:
            return read(self, peer, pages, blocks, timeout)
        failures -= 1
        half = -(-len(blocks) // 2)
        rows = np.frombuffer(pages.rows, dtype="<i8").reshape(len(self.cache.layers), -1, 3)
        first = Pages(pages.kind, np.ascontiguousarray(rows[:, :half]).tobytes())
        read(self, peer, first, blocks[:half], timeout)
        raise TransferError(f"injected: the link went down after {half} of {len(blocks)} pages")

    NixlCache.read = read_half_then_fail
