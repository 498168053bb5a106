"""Per-microbatch dispatch and combine times from DeepEP's published figures (H800 + CX7
InfiniBand), for fabrics where no measurement of ours exists. A measured time is a plain
`Term(..., source="measured")` from ep-comm's own benchmark on the fabric at hand.

Both conversions are linear in bytes, as docs/reproduction.md's method prescribes. Low-latency
figures were taken at 128 tokens a rank; below that latency dominates and the scaled time is
optimistic.
"""

from __future__ import annotations

from ref_server.repro import published
from ref_server.repro.shapes import V3, V3Dims
from ref_server.repro.terms import Term, derived, positive

PUBLISHED_FABRIC = "published-H800-IB"


def low_latency_seconds(name: str, published_time: Term, pairs: float, dims: V3Dims = V3) -> Term:
    """One low-latency dispatch or combine of `pairs` (token, expert) pairs a rank: the
    published time at DeepEP's 128 tokens x top-k pairs, scaled by pairs."""
    positive(published_time)
    reference = published.DEEPEP_LL_TOKENS.value * dims.num_experts_per_tok
    if pairs <= 0:
        raise ValueError(f"{name}: pairs must be greater than zero, got {pairs}")
    return derived(
        name,
        published_time.value * pairs / reference,
        "s",
        [published_time, published.DEEPEP_LL_TOKENS],
        f"{PUBLISHED_FABRIC}: {published_time.name} x {pairs:g} / {reference:g} pairs",
    )


def normal_seconds(
    name: str,
    bandwidth: Term,
    tokens: float,
    destinations_per_token: Term,
    fp8: bool,
    dims: V3Dims = V3,
) -> Term:
    """One normal-mode (prefill) dispatch or combine of `tokens` a rank, at a published RDMA
    bandwidth counted as DeepEP counts it: each token once per destination node (own node
    included), hidden x 2 bytes in BF16, x (1 + 4/128) / 2 in FP8. destinations_per_token:
    the mean number of nodes a token's experts are on (at most 4 under V3's group-limited
    routing); measured from `is_token_in_rank` where a run exists, else assumed."""
    positive(bandwidth)
    positive(destinations_per_token)
    if tokens <= 0:
        raise ValueError(f"{name}: tokens must be greater than zero, got {tokens}")
    bytes_per_token = dims.hidden_size * 2 * ((1 + 4 / 128) / 2 if fp8 else 1)
    moved = tokens * destinations_per_token.value * bytes_per_token
    return derived(
        name,
        moved / bandwidth.value,
        "s",
        [bandwidth, destinations_per_token],
        f"{PUBLISHED_FABRIC}: {moved:.4g} B at {bandwidth.name}",
    )
