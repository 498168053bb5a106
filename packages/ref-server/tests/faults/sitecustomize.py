"""Faults for the tests, in processes they start (a deployment's): Python imports this module
at startup when this folder leads PYTHONPATH. With FAIL_NIXL_READS=N in the environment, the
process's first N NIXL reads fail midway, as a link that goes down would: the first half of
the request's pages are read for real, then the read raises TransferError."""

import os

FAIL_NIXL_READS = "REF_SERVER_TEST_FAIL_NIXL_READS"

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
