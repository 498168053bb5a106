"""Splitting one batch into two microbatches, A then B, of about equal cost.

Two-batch overlap hides one microbatch's communication behind the other's compute, which works
only if the two take about as long. The split is over the batch's flattened new tokens, in
order: A takes a prefix of the rows, B the rest. Attention dominates long prefills and its cost
grows with each token's position, so balancing token counts (SGLang's rule) can leave A with
much more work than B; `split_prefill` balances attention cost by default.

Pure functions on lengths: no torch, nothing but index ranges out.
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

BALANCES = ("attention", "tokens")


@dataclass(frozen=True)
class Split:
    """How one batch becomes two microbatches, A then B, over its flattened new tokens.

    tokens: the rows of the flattened new tokens for A and for B; A's come first, and together
    they cover every row.
    seqs: the sequence indices of A and of B; a sequence cut in two is in both (A's last, B's
    first).
    cut: the new tokens of the cut sequence that go to A; 0 when the split is at a sequence
    boundary.
    """

    tokens: tuple[range, range]
    seqs: tuple[range, range]
    cut: int


def split_decode(context_lens: Sequence[int]) -> Split:
    """Split a decode batch (one new token per sequence) at the sequence boundary that best
    balances the summed context, since each new token attends to its whole context.

    context_lens[i]: the tokens in sequence i's cache after the step, its new token included.
    Ties go to the boundary nearest the middle, then to the earlier one.
    """
    context_lens = _integers("context_lens", context_lens)
    count = len(context_lens)
    if count < 2:
        noun = "sequence" if count == 1 else "sequences"
        raise ValueError(f"cannot split {count} {noun} into two microbatches")
    for index, context in enumerate(context_lens):
        if context < 1:
            raise ValueError(
                f"context_lens[{index}] is {context}: a decoding sequence's cache holds at least "
                "its new token"
            )
    return _split_at(len(context_lens) * [1], _best_boundary(context_lens), 0)


def split_prefill(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    balance: str = "attention",
    threshold: float = 0.48,
) -> Split:
    """Split a prefill (or mixed) batch into two microbatches of about equal cost.

    query_lens[i]: the new tokens of sequence i; context_lens[i]: the tokens in its cache after
    the step, new ones included. A new token at position p of its sequence costs p + 1 (the keys
    it attends to) with balance="attention", or 1 with balance="tokens".

    The split is at the sequence boundary that best balances cost (ties as in `split_decode`),
    unless that leaves either side with less than `threshold` of the total, or there is one
    sequence; then the batch is cut where the cumulative cost first reaches half, or one row
    earlier if that balances better ("two-chunk"). A gets the cut sequence's first tokens and B
    the rest, since B's part attends to A's through the cache. Neither side is ever empty.
    """
    query_lens = _integers("query_lens", query_lens)
    context_lens = _integers("context_lens", context_lens)
    _check_prefill(query_lens, context_lens, balance, threshold)
    costs = [_cost(q, q, c, balance) for q, c in zip(query_lens, context_lens, strict=True)]
    total = sum(costs)
    if len(costs) >= 2:
        boundary = _best_boundary(costs)
        ahead = sum(costs[:boundary])
        if min(ahead, total - ahead) >= threshold * total:
            return _split_at(query_lens, boundary, 0)
    return _two_chunk(query_lens, context_lens, costs, balance)


def _check_prefill(
    query_lens: list[int], context_lens: list[int], balance: str, threshold: float
) -> None:
    if balance not in BALANCES:
        raise ValueError(f"balance must be 'attention' or 'tokens', got {balance!r}")
    if not 0 <= threshold <= 0.5:
        raise ValueError(f"threshold must be in [0, 0.5], got {threshold}")
    if len(query_lens) != len(context_lens):
        raise ValueError(
            f"query_lens has {len(query_lens)} entries but context_lens has {len(context_lens)}"
        )
    for index, (query, context) in enumerate(zip(query_lens, context_lens, strict=True)):
        if query < 1:
            raise ValueError(
                f"query_lens[{index}] is {query}: every sequence has at least one new token"
            )
        if context < query:
            raise ValueError(
                f"sequence {index} has {query} new tokens but context_lens[{index}] is {context}: "
                "the cache holds the new tokens too, so context_lens >= query_lens"
            )
    tokens = sum(query_lens)
    if tokens < 2:
        noun = "new token" if tokens == 1 else "new tokens"
        raise ValueError(f"cannot split a batch of {tokens} {noun} into two microbatches")


def _integers(name: str, values: Sequence[int]) -> list[int]:
    try:
        return [operator.index(v) for v in values]
    except TypeError as error:
        raise ValueError(f"{name} must hold integers: {error}") from None


def _cost(rows: int, query: int, context: int, balance: str) -> int:
    """The cost of the first `rows` new tokens of a sequence."""
    if balance == "tokens":
        return rows
    first = context - query + 1  # the first new token attends to the cached prefix and itself
    return rows * first + rows * (rows - 1) // 2


def _best_boundary(costs: list[int]) -> int:
    """The k in [1, len - 1] for which costs[:k] and costs[k:] are closest."""
    total, middle = sum(costs), len(costs) // 2
    before = [0, *accumulate(costs)]
    return min(range(1, len(costs)), key=lambda k: (abs(2 * before[k] - total), abs(k - middle), k))


def _two_chunk(
    query_lens: list[int], context_lens: list[int], costs: list[int], balance: str
) -> Split:
    total = sum(costs)
    seq, before = 0, 0  # the sequence to cut, and the cost of those ahead of it
    while 2 * (before + costs[seq]) < total:
        before += costs[seq]
        seq += 1
    query, context = query_lens[seq], context_lens[seq]

    def excess(rows: int) -> int:  # A's cost minus B's when A takes `rows` of this sequence
        return 2 * (before + _cost(rows, query, context, balance)) - total

    reached = bisect_left(range(query + 1), 0, key=excess)
    # The row that reaches half may overshoot it by more than stopping one row short falls short.
    rows = reached - 1 if -excess(reached - 1) < excess(reached) else reached
    return _split_at(query_lens, seq, rows)


def _split_at(query_lens: list[int], seq: int, rows: int) -> Split:
    """A takes the sequences before `seq` and the first `rows` new tokens of `seq`."""
    if rows == query_lens[seq]:
        seq, rows = seq + 1, 0
    row = sum(query_lens[:seq]) + rows
    a_stop = seq + 1 if rows else seq  # the cut sequence is in A too
    return Split(
        tokens=(range(row), range(row, sum(query_lens))),
        seqs=(range(a_stop), range(seq, len(query_lens))),
        cut=rows,
    )
