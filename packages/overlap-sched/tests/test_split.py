"""Splitting a batch into two microbatches: properties over random batches, then worked cases."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from overlap_sched.split import Split, split_decode, split_prefill

# --- what every split must satisfy ---------------------------------------------------------


def row_costs(query_lens, context_lens, balance):
    """Each flattened new token's cost, and the sequence it belongs to."""
    costs, owners = [], []
    for seq, (q, c) in enumerate(zip(query_lens, context_lens, strict=True)):
        for position in range(c - q, c):
            costs.append(position + 1 if balance == "attention" else 1)
            owners.append(seq)
    return costs, owners


def excess(costs, rows):
    """A's cost minus B's when A takes the first `rows` rows."""
    return 2 * sum(costs[:rows]) - sum(costs)


def check_shape(split, query_lens):
    a, b = split.tokens
    total = sum(query_lens)
    assert a.start == 0 and a.stop == b.start and b.stop == total
    assert a.step == b.step == 1
    assert len(a) > 0 and len(b) > 0
    _, owners = row_costs(query_lens, query_lens, "tokens")
    assert list(split.seqs[0]) == sorted({owners[r] for r in a})
    assert list(split.seqs[1]) == sorted({owners[r] for r in b})
    shared = set(split.seqs[0]) & set(split.seqs[1])
    if split.cut:
        assert shared == {split.seqs[0][-1]} == {split.seqs[1][0]}
        assert split.cut == sum(owners[r] == split.seqs[0][-1] for r in a)
        assert 0 < split.cut < query_lens[split.seqs[0][-1]]
    else:
        assert not shared


batches = st.lists(
    st.tuples(st.integers(1, 40), st.integers(0, 300)), min_size=1, max_size=8
).filter(lambda seqs: sum(q for q, _ in seqs) >= 2)  # (new tokens, cached tokens) per sequence


@given(batches, st.sampled_from(["attention", "tokens"]), st.floats(0, 0.5))
def test_prefill_split_properties(seqs, balance, threshold):
    query_lens = [q for q, _ in seqs]
    context_lens = [q + cached for q, cached in seqs]
    split = split_prefill(query_lens, context_lens, balance=balance, threshold=threshold)
    check_shape(split, query_lens)

    costs, _ = row_costs(query_lens, context_lens, balance)
    ours = abs(excess(costs, split.tokens[1].start))
    best_anywhere = min(abs(excess(costs, rows)) for rows in range(1, len(costs)))
    boundaries = [sum(query_lens[:k]) for k in range(1, len(seqs))]
    if not boundaries:  # one sequence: it must be cut, at the best row
        assert split.cut > 0 and ours == best_anywhere
        return
    best_boundary = min(abs(excess(costs, rows)) for rows in boundaries)
    smaller_side = (sum(costs) - best_boundary) // 2  # at that boundary
    balanced = smaller_side >= threshold * sum(costs)
    assert ours <= best_boundary
    if balanced:
        assert split.cut == 0 and ours == best_boundary
    else:
        assert ours == best_anywhere
    if split.cut:
        assert not balanced


@given(st.lists(st.integers(1, 1000), min_size=2, max_size=12))
def test_decode_split_is_the_best_boundary(context_lens):
    split = split_decode(context_lens)
    check_shape(split, [1] * len(context_lens))
    assert split.tokens == split.seqs and split.cut == 0
    n = len(context_lens)
    best = min(
        range(1, n),
        key=lambda k: (abs(excess(context_lens, k)), abs(k - n // 2), k),
    )
    assert split.tokens[1].start == best
    # a decode batch is a prefill of one new token per sequence that never cuts
    assert split == split_prefill([1] * n, context_lens, threshold=0)


# --- worked cases --------------------------------------------------------------------------


def test_one_long_request_is_cut_inside():
    # positions 0..999 cost 1..1000: A's 707 tokens cost 250278 of 500500, B's 293 the rest
    split = split_prefill([1000], [1000])
    assert split == Split(tokens=(range(707), range(707, 1000)), seqs=(range(1), range(1)), cut=707)
    by_tokens = split_prefill([1000], [1000], balance="tokens")
    assert by_tokens.cut == 500


def test_one_long_request_after_a_cached_prefix():
    # 3000 cached tokens make the costs 3001..4000, nearly even: A's 536 cost 1751916 of 3500500
    split = split_prefill([1000], [4000])
    assert split.cut == 536
    assert split.tokens == (range(536), range(536, 1000))


def test_two_tokens_of_one_request():
    split = split_prefill([2], [2])
    assert split == Split(tokens=(range(1), range(1, 2)), seqs=(range(1), range(1)), cut=1)


def test_one_very_long_sequence_among_short_ones():
    # costs 55, 55, 8002000, 55: no boundary comes close, so sequence 2 is cut after 2828 tokens
    query_lens = [10, 10, 4000, 10]
    split = split_prefill(query_lens, query_lens)
    assert split == Split(
        tokens=(range(2848), range(2848, 4030)), seqs=(range(3), range(2, 4)), cut=2828
    )
    by_tokens = split_prefill(query_lens, query_lens, balance="tokens")
    assert by_tokens == Split(
        tokens=(range(2015), range(2015, 4030)), seqs=(range(3), range(2, 4)), cut=1995
    )


def test_sglang_token_balance_and_attention_balance_cut_different_sequences():
    query_lens, context_lens = [100, 300, 50, 50], [1100, 300, 50, 50]
    # tokens: boundaries give 100 | 400 or 400 | 100 of 500; cut sequence 1 at 250 tokens
    by_tokens = split_prefill(query_lens, context_lens, balance="tokens")
    assert by_tokens == Split(
        tokens=(range(250), range(250, 500)), seqs=(range(2), range(1, 4)), cut=150
    )
    # attention: sequence 0's 100 tokens after 1000 cached cost 105050 of 152750
    by_attention = split_prefill(query_lens, context_lens)
    assert by_attention == Split(
        tokens=(range(74), range(74, 500)), seqs=(range(1), range(4)), cut=74
    )


def test_balanced_boundary_is_kept():
    split = split_prefill([100, 100, 100, 100], [100, 100, 100, 100])
    assert split == Split(tokens=(range(200), range(200, 400)), seqs=(range(2), range(2, 4)), cut=0)


def test_threshold_decides_between_boundary_and_cut():
    # the boundary gives A 40% of the tokens
    assert split_prefill([40, 60], [40, 60], balance="tokens", threshold=0.4).cut == 0
    assert split_prefill([40, 60], [40, 60], balance="tokens", threshold=0.41).cut == 10
    assert split_prefill([1, 99], [1, 99], balance="tokens", threshold=0).cut == 0


def test_two_chunk_may_land_on_a_boundary():
    # one token each: nothing to cut inside, so the boundary stands however unbalanced
    split = split_prefill([1, 1], [1, 100])
    assert split == Split(tokens=(range(1), range(1, 2)), seqs=(range(1), range(1, 2)), cut=0)


def test_decode_of_two_sequences():
    split = split_decode([5, 1000])
    assert split == Split(tokens=(range(1), range(1, 2)), seqs=(range(1), range(1, 2)), cut=0)


def test_decode_balances_context_not_sequences():
    # prefix sums 100, 300, 600 of 1000: k = 3, not the middle k = 2
    split = split_decode([100, 200, 300, 400])
    assert split.tokens == (range(3), range(3, 4)) and split.seqs == split.tokens


def test_decode_tie_goes_to_the_middle():
    # k = 2 and k = 3 both leave 10 against 15; n // 2 = 2
    assert split_decode([5, 5, 5, 5, 5]).tokens == (range(2), range(2, 5))


@pytest.mark.parametrize(
    ("query_lens", "context_lens", "options", "message"),
    [
        ([1], [5], {}, "cannot split a batch of 1 new token"),
        ([], [], {}, "cannot split a batch of 0 new tokens"),
        ([2, 2], [2], {}, "query_lens has 2 entries but context_lens has 1"),
        ([2, 0], [2, 3], {}, r"query_lens\[1\] is 0"),
        ([2, 5], [2, 4], {}, r"sequence 1 has 5 new tokens but context_lens\[1\] is 4"),
        (
            [2, 2],
            [2, 2],
            {"balance": "flops"},
            "balance must be 'attention' or 'tokens', got 'flops'",
        ),
        ([2, 2], [2, 2], {"threshold": 0.6}, r"threshold must be in \[0, 0.5\], got 0.6"),
        ([2, 2], [2, 2], {"threshold": -0.1}, r"threshold must be in \[0, 0.5\], got -0.1"),
        ([2.5, 2], [3, 2], {}, "query_lens must hold integers"),
    ],
)
def test_bad_prefill_input(query_lens, context_lens, options, message):
    with pytest.raises(ValueError, match=message):
        split_prefill(query_lens, context_lens, **options)


@pytest.mark.parametrize(
    ("context_lens", "message"),
    [
        ([7], "cannot split 1 sequence into two microbatches"),
        ([], "cannot split 0 sequences into two microbatches"),
        ([3, 0], r"context_lens\[1\] is 0"),
    ],
)
def test_bad_decode_input(context_lens, message):
    with pytest.raises(ValueError, match=message):
        split_decode(context_lens)
