"""DeepSeek's expert placement (`ref_server.balance.rebalance_experts`): the published README
example, outputs of the published implementation on Zipf loads (stored in
tests/data/eplb_expected.json, produced by running deepseek-ai/EPLB's eplb.py), invariants
over arbitrary loads (hypothesis), balancedness against round-robin, and bad arguments."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref_server.balance import balancedness, rebalance_experts, round_robin

README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
EXPECTED = json.loads((Path(__file__).parent / "data" / "eplb_expected.json").read_text())


def test_the_readme_example():
    placement = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    assert placement.phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    assert placement.logcnt.tolist() == [
        [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
        [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1],
    ]
    assert placement.log2phy[0].tolist() == [
        [12, -1], [15, 13], [11, -1], [6, -1], [7, 5], [0, 2],
        [1, -1], [3, -1], [4, -1], [9, -1], [8, 10], [14, -1],
    ]  # fmt: skip
    got = balancedness(README_WEIGHT, placement.phy2log, placement.logcnt, 8)
    layer0 = np.mean([121.5, 86.5, 125, 113, 147.5, 131.5, 156, 152]) / 156  # the GPUs' loads
    np.testing.assert_allclose(got, [layer0, 0.805], rtol=1e-3)
    assert round(got[0], 3) == 0.828


def test_the_global_policy_when_groups_do_not_divide_among_nodes():
    placement = rebalance_experts(README_WEIGHT, 16, 3, 2, 8)
    assert placement.phy2log[0].tolist() == [10, 6, 10, 7, 0, 2, 11, 4, 5, 9, 5, 4, 8, 3, 1, 1]


@pytest.mark.parametrize(
    "case", EXPECTED["cases"], ids=lambda c: f"{len(c['weight'][0])}x{c['num_replicas']}"
)
def test_the_published_implementation_s_placements_on_zipf_loads(case):
    """phy2log and logcnt exactly; log2phy the same slots for each expert. Replicas of one
    expert weigh the same, and the published code orders such ties through torch's unstable
    sort, so which of an expert's slots holds which replica rank is not defined there."""
    args = (case[k] for k in ("num_replicas", "num_groups", "num_nodes", "num_gpus"))
    placement = rebalance_experts(case["weight"], *args)
    assert placement.phy2log.tolist() == case["phy2log"]
    assert placement.logcnt.tolist() == case["logcnt"]
    assert np.array_equal(np.sort(placement.log2phy, -1), np.sort(case["log2phy"], -1))


layouts = st.sampled_from(
    # logical, replicas, groups, nodes, gpus: DeepSeek-like and small; 3 groups over 2 nodes is global
    [(12, 16, 4, 2, 8), (64, 64, 8, 2, 8), (64, 80, 4, 2, 8), (48, 64, 3, 2, 8), (32, 36, 4, 1, 4)]
)


@settings(max_examples=40, deadline=None)
@given(layout=layouts, data=st.data())
def test_every_placement_is_consistent(layout, data):
    logical, replicas, groups, nodes, gpus = layout
    loads = st.lists(st.integers(0, 1000), min_size=logical, max_size=logical)
    weight = np.array(data.draw(st.lists(loads, min_size=1, max_size=3)))
    placement = rebalance_experts(weight, replicas, groups, nodes, gpus)
    phy2log, log2phy, logcnt = placement.phy2log, placement.log2phy, placement.logcnt
    assert phy2log.shape == (len(weight), replicas)
    assert (logcnt >= 1).all() and (logcnt.sum(-1) == replicas).all()
    for layer in range(len(weight)):
        assert np.array_equal(np.bincount(phy2log[layer], minlength=logical), logcnt[layer])
        for expert in range(logical):
            slots = log2phy[layer, expert]
            assert (slots[: logcnt[layer, expert]] >= 0).all() and (
                slots[logcnt[layer, expert] :] == -1
            ).all()
            assert (phy2log[layer, slots[: logcnt[layer, expert]]] == expert).all()
        if groups % nodes == 0:  # hierarchical: a group's experts and replicas on one node
            node_of_slot = np.arange(replicas) // (replicas // nodes)
            group_of_slot = phy2log[layer] // (logical // groups)
            for group in range(groups):
                assert len(set(node_of_slot[group_of_slot == group])) == 1


@pytest.mark.parametrize("exponent", [1.0, 1.25, 1.5])
@pytest.mark.parametrize(
    "gpus, nodes",  # DeepSeek's prefill (EP 32, 9 slots a GPU) and decode (EP 144, 2 a GPU)
    [(32, 4), (144, 18)],
)
def test_balancedness_is_no_worse_than_round_robin(gpus, nodes, exponent):
    logical, replicas, groups = 256, 288, 8
    rng = np.random.default_rng(int(exponent * 100) + gpus)
    ranks = np.argsort(rng.random((4, logical)), axis=1) + 1
    weight = 1e5 / ranks**exponent
    placement = rebalance_experts(weight, replicas, groups, nodes, gpus)
    balanced = balancedness(weight, placement.phy2log, placement.logcnt, gpus)
    baseline = balancedness(weight, *round_robin(logical, replicas, len(weight)), gpus)
    assert (balanced >= baseline).all() and balanced.mean() > baseline.mean(), (balanced, baseline)


@pytest.mark.parametrize(
    "args, message",
    [
        (([[1, 2, 3, 4, 5]], 4, 1, 1, 2), r"num_replicas \(4\) must be at least the 5"),
        (([1, 2, 3, 4], 4, 1, 1, 2), r"weight must be \[layers, logical experts\]"),
        (([[1, -2, 3, 4]], 4, 1, 1, 2), "non-negative"),
        (([[1, float("nan"), 3, 4]], 4, 1, 1, 2), "finite"),
        (([[1, 2, 3, 4]], 6, 1, 1, 4), r"num_replicas \(6\) must be a multiple of num_gpus \(4\)"),
        (
            ([[1, 2, 3, 4]], 4, 1, 3, 4),
            r"num_gpus \(4\) must be a positive multiple of num_nodes \(3\)",
        ),
        (([[1, 2, 3, 4]], 4, 3, 1, 2), "the 4 logical experts do not split into 3 groups"),
        (([[1, 2, 3, 4]], 4, 0, 1, 2), "num_groups must be at least 1"),
    ],
)
def test_bad_arguments_are_a_value_error_naming_the_numbers(args, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(*args)


def drifted_layouts():
    """(weight, drifted weight) per DeepSeek layout: Zipf loads, then each off by ~10 %."""
    rng = np.random.default_rng(11)
    weight = 1e5 / (np.argsort(rng.random((3, 256)), axis=1) + 1) ** 1.2
    drifted = np.clip(weight * (1 + 0.1 * rng.standard_normal(weight.shape)), 0, None)
    return weight, drifted


@pytest.mark.parametrize("gpus, nodes", [(32, 4), (144, 18), (8, 1)])
def test_keeping_in_place_moves_less_and_changes_no_gpu_s_load(gpus, nodes):
    """Against a plain rebalance of drifted loads: the same experts on each GPU up to which
    GPU of a node (so the same balancedness, and each group still on one node), fewer slots
    moved; the loads unchanged, nothing moved."""
    weight, drifted = drifted_layouts()
    replicas = 288
    first = rebalance_experts(weight, replicas, 8, nodes, gpus)
    assert first.moved is None
    plain = rebalance_experts(drifted, replicas, 8, nodes, gpus)
    kept = rebalance_experts(drifted, replicas, 8, nodes, gpus, previous=first.phy2log)
    assert np.array_equal(kept.logcnt, plain.logcnt)
    per_gpu, per_node = replicas // gpus, replicas // nodes

    def gpus_of(phy2log, layer, node):
        slots = phy2log[layer, node * per_node : (node + 1) * per_node]
        return sorted(tuple(sorted(g)) for g in slots.reshape(-1, per_gpu).tolist())

    for layer in range(len(weight)):
        for node in range(nodes):
            assert gpus_of(kept.phy2log, layer, node) == gpus_of(plain.phy2log, layer, node)
        for expert in range(256):  # log2phy: the inverse, ranks in slot order
            slots = kept.log2phy[layer, expert, : kept.logcnt[layer, expert]]
            assert (kept.phy2log[layer, slots] == expert).all() and (np.diff(slots) > 0).all()
    np.testing.assert_allclose(
        balancedness(drifted, kept.phy2log, kept.logcnt, gpus),
        balancedness(drifted, plain.phy2log, plain.logcnt, gpus),
    )
    np.testing.assert_array_equal(kept.moved, (kept.phy2log != first.phy2log).mean(-1))
    assert (kept.moved < (plain.phy2log != first.phy2log).mean(-1)).all()
    again = rebalance_experts(weight, replicas, 8, nodes, gpus, previous=first.phy2log)
    assert (again.moved == 0).all() and np.array_equal(again.phy2log, first.phy2log)


def test_a_previous_placement_of_another_shape_is_a_value_error():
    with pytest.raises(ValueError, match=r"previous must be phy2log's shape \(2, 16\)"):
        rebalance_experts(README_WEIGHT, 16, 4, 2, 8, previous=np.zeros((2, 12), dtype=int))
