"""bench_dsa.py's arithmetic on the CPU (the script itself runs on a GPU only): the FLOPs and
bytes of dense MLA and of DSA's parts at V3.2's shapes, the bounds over given ceilings, and the
context from which DSA pays, against values worked out by hand."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))  # its imports of this folder's other scripts
        yield importlib.import_module("bench_dsa")


def test_dense_work_reads_each_sequence_once_and_scores_every_token_it_sees(bench):
    # 2 * 128 heads * (576 + 512) = 278,528 FLOPs a (query, token) pair
    assert bench.dense_work(2, 4096, 1, 656) == (278_528 * 8192, 2 * 4096 * 656 + 557_056)
    # s_q 2: the first new token sees 4,095 tokens, the second 4,096
    assert bench.dense_work(2, 4096, 2, 656) == (278_528 * 16_382, 5_373_952 + 1_114_112)
    assert bench.dense_work(1, 2048, 1, 1152) == (570_425_344, 2_359_296 + 278_528)


def test_dsa_work_counts_every_key_in_the_logits_and_the_picked_tokens_in_sparse_mla(bench):
    work = bench.dsa_work(2, 4096, 1, 656)
    # 64 heads * 128: 16,384 FLOPs a key; 132 bytes a key, 132 a query head, 4 a logit
    assert work["logits"] == (16_384 * 8192, 2 * (540_672 + 8_448 + 16_384))
    assert work["topk"] == (0, 2 * 4096 * 4 + 2 * 2048 * 4)
    assert work["slots"] == (0, 2 * 2048 * 8)
    assert work["sparse_mla"] == (278_528 * 4096, 4096 * 656 + 557_056)
    # a context of top-k tokens at s_q 2: the first query has 2,047 to pick from
    assert bench.dsa_work(1, 2048, 2, 656)["sparse_mla"] == (
        278_528 * 4095,
        4095 * 656 + 2 * 128 * 1088 * 2,
    )


def test_bounds_take_each_parts_ceiling_and_dsa_sums_its_parts(bench):
    limits = dict(fp8_flops=1e14, bf16_flops=5e14, copy_bytes_per_s=2e12)
    bounds = bench.bounds_us(2, 4096, 1, "fp8", limits)
    expected = {
        "dense": 4.563402752,  # 2.2817e9 FLOPs / 5e14 (5.93 MB / 2e12 is 2.97 µs)
        "logits": 1.34217728,  # 1.342e8 FLOPs / 1e14, the FP8 ceiling (1.13 MB: 0.57 µs)
        "topk": 0.024576,
        "slots": 0.016384,
        "sparse_mla": 2.281701376,  # 1.1409e9 FLOPs / 5e14 (3.24 MB: 1.62 µs)
        "dsa": 3.664838656,
    }
    assert bounds == pytest.approx(expected, rel=1e-9)
    assert bench.bounds_us(2, 4096, 1, "bf16", limits)["dense"] == pytest.approx(
        (2 * 4096 * 1152 + 557_056) / 2e12 * 1e6, rel=1e-9
    )


def test_dsa_pays_from_the_shortest_context_after_which_it_stays_faster(bench):
    times = {  # batch: (dense, DSA) at 4K, 8K, 16K, 32K, 64K
        32: [(10, 12), (20, 15), (30, 35), (60, 40), (120, 50)],
        64: [(10, 12), (20, 20), (40, 45), (80, 90), (160, 170)],
        128: [(20, 20), (40, 15), (80, 20), (160, 25), (320, 30)],  # a tie does not pay
    }
    rows = [
        dict(batch=batch, s_q=1, context=4096 << i, dense_us=dense, dsa_us=dsa)
        for batch, pairs in times.items()
        for i, (dense, dsa) in reversed(list(enumerate(pairs)))
    ]
    assert bench.pays_from(rows, "dense_us", "dsa_us") == {
        "b32 s_q1": 32768,
        "b64 s_q1": None,
        "b128 s_q1": 8192,
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--s-q", "3"], "--s-q takes 1 and 2"),
        (["--contexts", "4096,1000"], "--contexts must be multiples of 64"),
        (["--batches", "0"], "--batches and --reps must be positive"),
    ],
)
def test_bad_options_are_named(bench, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["bench_dsa.py", *argv])
    with pytest.raises(SystemExit):
        bench.main()
    assert message in capsys.readouterr().err
