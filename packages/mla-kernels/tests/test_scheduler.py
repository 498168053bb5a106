import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_kernels import scheduler
from mla_kernels.scheduler import BEGIN_BATCH, BEGIN_BLOCK, BEGIN_SPLIT, END_BATCH, END_BLOCK

seqlens_strategy = st.lists(
    st.one_of(st.just(0), st.integers(1, 64), st.integers(1, 5000)), min_size=1, max_size=40
)


def walk(metadata, blocks):
    """The (batch, block, piece index) each partition visits, as the kernel walks them."""
    visits = []
    for part, row in enumerate(metadata.tolist()):
        for batch in range(row[BEGIN_BATCH], row[END_BATCH] + 1):
            start = row[BEGIN_BLOCK] if batch == row[BEGIN_BATCH] else 0
            stop = row[END_BLOCK] if batch == row[END_BATCH] else blocks[batch]
            piece = row[BEGIN_SPLIT] if batch == row[BEGIN_BATCH] else 0
            visits += [(part, batch, block, piece) for block in range(start, stop)]
    return visits


@settings(max_examples=300, deadline=None)
@given(seqlens=seqlens_strategy, num_parts=st.integers(1, 140))
def test_every_block_is_visited_once_and_pieces_are_numbered(seqlens, num_parts):
    metadata, splits = scheduler.schedule(torch.tensor(seqlens, dtype=torch.int32), num_parts)
    assert metadata.shape == (num_parts, scheduler.METADATA_WIDTH) and metadata.dtype == torch.int32
    blocks = [-(-n // scheduler.BLOCK_TOKENS) for n in seqlens]
    visits = walk(metadata, blocks)
    assert sorted((b, k) for _, b, k, _ in visits) == [
        (b, k) for b, n in enumerate(blocks) for k in range(n)
    ]
    for batch, n in enumerate(blocks):
        pieces = {(part, piece) for part, b, _, piece in visits if b == batch}
        assert sorted(piece for _, piece in pieces) == list(
            range(splits[batch + 1] - splits[batch])
        )
        assert (splits[batch + 1] - splits[batch] == 0) == (n == 0)
    assert splits[-1] <= len(seqlens) + num_parts  # the bound the split workspace is sized by


@settings(max_examples=100, deadline=None)
@given(seqlens=seqlens_strategy, num_parts=st.integers(1, 140))
def test_partitions_are_balanced(seqlens, num_parts):
    metadata, _ = scheduler.schedule(torch.tensor(seqlens, dtype=torch.int32), num_parts)
    blocks = [-(-n // scheduler.BLOCK_TOKENS) for n in seqlens]
    overhead = scheduler.FIXED_OVERHEAD_BLOCKS
    total = sum(n + overhead * (n > 0) for n in blocks)
    per_part = -(-total // num_parts)
    for part in range(num_parts):
        visits = [v for v in walk(metadata[part : part + 1], blocks)]
        batches = {b for _, b, _, _ in visits}
        # A partition's blocks plus the overhead of the sequences it touches stay within one
        # share plus the overhead of the (at most two) sequences cut at its ends.
        assert len(visits) + overhead * len(batches) <= per_part + 2 * overhead


def test_large_batch_fills_parts_and_splits_long_sequences():
    seqlens = torch.tensor([4096] * 2 + [64] * 6, dtype=torch.int32)
    _, splits = scheduler.schedule(seqlens, 4)
    pieces = (splits[1:] - splits[:-1]).tolist()
    assert pieces[0] >= 2  # the long sequences are split across partitions
    assert pieces[2:] == [1] * 6
