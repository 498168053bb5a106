"""Expert slots in the model (replicas, routing to them, load counts), live re-placement, and
the instance's expert balancer, on the CPU (the tiny checkpoint at hidden size 128)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import ref_server.model as M
from ep_comm.testing import run_ranks
from ref_server.balance import read_placement, write_placement
from ref_server.engine import Engine, EplbConfig, ExpertBalancer, SchedulerConfig
from ref_server.model.expert_location import ExpertLocation, default_placement
from ref_server.model.expert_rebalance import Move, place_lost_experts, plan_moves

SCENARIOS = str(Path(__file__).with_name("model_scenarios.py"))


@pytest.fixture
def checkpoint(checkpoints, tmp_path) -> str:
    checkpoints.write(tmp_path, seed=21, hidden_size=128)
    return str(tmp_path)


def test_choices_go_to_the_replicas_of_their_expert_in_turn():
    location = ExpertLocation(num_logical=4, num_physical=8, ranks=2)
    location.place([2, 0, 3, 1, 0, 2, 0, 1])  # expert 0 in slots 1, 4, 6; 1 in 3, 7; 2 in 0, 5
    assert location.logical_to_physical.tolist() == [
        [1, 4, 6, -1, -1],
        [3, 7, -1, -1, -1],
        [0, 5, -1, -1, -1],
        [2, -1, -1, -1, -1],
    ]
    assert location.replica_count.tolist() == [3, 2, 2, 1]
    ids = torch.tensor([[0, 2], [0, 1], [0, 2], [3, 0]])
    # choice i = row * k + column goes to replica i mod count
    slots = location.to_physical(ids)
    assert slots.tolist() == [[1, 5], [6, 7], [4, 5], [2, 4]]
    # a CUDA graph's padding row (ids -1: no expert) goes to no slot and counts nowhere
    padding = torch.tensor([[False], [False], [True], [False]])
    slots = location.to_physical(ids.masked_fill(padding, -1))
    assert slots.tolist() == [[1, 5], [6, 7], [-1, -1], [2, 4]]
    location.count(slots)
    assert location.load.tolist() == [0, 1, 1, 0, 1, 1, 1, 1]
    location.received += torch.arange(4, dtype=torch.int32)
    # what rank 1's slots 4..7 received through the low-latency dispatch joins its routed ones
    assert location.take_load(first_slot=4).tolist() == [0, 1, 1, 0, 1, 2, 3, 4]
    assert location.load.sum() == 0 and location.received.sum() == 0
    assert default_placement(4, 7).tolist() == [0, 1, 2, 3, 0, 1, 2]


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        ([0, 1, 2, 0], "experts \\[3\\] have no slot"),
        ([0, 1, 2, 4, 3], "needs 4 slots"),
        ([0, 1, 2, 3], None),
        ([0, 1, -1, 3], "in \\[0, 4\\)"),
    ],
)
def test_a_placement_must_hold_every_expert(placement, message):
    location = ExpertLocation(num_logical=4, num_physical=4)
    if message is None:
        location.place(placement)
        return
    with pytest.raises(ValueError, match=message):
        location.place(placement)
    with pytest.raises(ValueError, match="cannot hold"):
        ExpertLocation(num_logical=4, num_physical=3)
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        ExpertLocation(num_logical=4, num_physical=4, ranks=3)


def test_a_model_rejects_placements_that_do_not_fit(checkpoint):
    with pytest.raises(ValueError, match="a row per MoE layer \\(2\\)"):
        M.from_pretrained(checkpoint, expert_placement=torch.arange(8)[None])
    with pytest.raises(ValueError, match="9 slots per layer, not the 10"):
        M.from_pretrained(
            checkpoint, num_physical_experts=10, expert_placement=torch.zeros(2, 9, dtype=int)
        )
    with pytest.raises(ValueError, match="experts \\[1, 2"):
        M.from_pretrained(checkpoint, expert_placement=torch.zeros(2, 8, dtype=int))
    with pytest.raises(ValueError, match="cannot hold 8"):
        M.from_pretrained(checkpoint, num_physical_experts=6)


def test_moves_copy_locally_first_then_ride_then_spread_over_the_holders():
    old = [0, 1, 2, 3, 4, 5, 0, 1]  # two ranks of 4 slots; experts 0 and 1 twice
    new = [0, 0, 2, 3, 4, 1, 5, 0]
    assert plan_moves(old, new, ranks=2) == [
        Move(1, 0),  # expert 0 from rank 0's own slot 0
        Move(5, 7),  # expert 1: rank 1 holds it in slot 7
        Move(6, 5),  # expert 5 from slot 5, itself overwritten (sources are read first)
        Move(7, 6),  # expert 0 from slot 6, overwritten too
    ]
    # elsewhere: holder (slot mod holders), so rank 2 takes expert 0 from rank 0, 1 from rank 1
    assert plan_moves([0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 0, 1], ranks=3) == [
        Move(2, 4),
        Move(3, 5),
        Move(4, 0),
        Move(5, 3),
    ]
    # a rank taking one expert from a peer into two slots receives it once
    assert plan_moves([0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 2, 2], ranks=2) == [
        Move(4, 2),
        Move(5, 4, ride=True),
    ]
    assert plan_moves([0, 1], [0, 1], ranks=1) == []
    with pytest.raises(ValueError, match="expert 2 has no slot"):
        plan_moves([0, 1], [0, 2], ranks=1)


def test_lost_experts_go_to_empty_slots_then_in_place_of_the_lightest_copies():
    """Heaviest first, each on the rank with the least load a copy: expert 5 (load 9) to
    rank 0's empty slot, 4 (load 5) to rank 1's; without empty slots, expert 3 replaces a copy
    of expert 2 (held three times: the lightest a copy), on rank 1."""
    load = np.array([1, 1, 1, 1, 5, 9, 1, 1], dtype=float)
    kept = np.array([0, 1, 2, -1, 6, 7, 3, -1])
    assert place_lost_experts(kept, load, 4).tolist() == [0, 1, 2, 5, 6, 7, 3, 4]
    assert kept.tolist() == [0, 1, 2, -1, 6, 7, 3, -1]  # not changed in place
    full = np.array([0, 1, 1, 2, 2, 2])
    assert place_lost_experts(full, np.ones(4), 3).tolist() == [0, 1, 1, 3, 2, 2]
    assert place_lost_experts(np.array([0, 1, 2, 3]), np.ones(4), 2).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("world", [1, 2])
def test_balanced_experts_serve_as_one_process(checkpoint, world):
    run_ranks(world, SCENARIOS, "balanced_experts_serve_as_one_process", checkpoint, limit=600)


def test_the_balancer_replicates_the_hot_experts_and_saves_the_placement(checkpoint, tmp_path):
    """Routing skewed onto expert 5 (its router bias raised): after a window the balancer
    gives the spare slots to the hottest experts, so that the largest share of the window's
    load a slot takes is below the default placement's (or equal, where three experts tie for
    two spare slots), moves every layer over the next steps, and writes the
    placement, which a new model loads."""
    model = M.from_pretrained(checkpoint, num_physical_experts=10)
    for moe in model.moe_layers():
        moe.gate.e_score_correction_bias[5] += 10.0
    saved = tmp_path / "placement.json"
    config = SchedulerConfig(num_blocks=16, block_size=16, max_model_len=256)
    engine = Engine(model, config, eplb=EplbConfig(3, save_to=saved))
    engine.generate([list(range(10, 40)), list(range(50, 61))], M.SamplingParams(max_tokens=8))
    balancer = engine.runner.expert_balancer
    assert balancer.rebalances >= 2
    balancer.move()  # what a last window left to move
    placement, load = balancer.placement(), balancer.last_load
    assert load[:, 5].tolist() == load.max(axis=1).tolist()
    default = np.bincount(default_placement(8, 10), minlength=8)
    hottest = [
        (row / np.bincount(experts, minlength=8)).max()
        for row, experts in zip(load, placement, strict=True)
    ]
    before = (load / default).max(axis=1)
    assert (hottest <= before).all() and (hottest < before).any(), (hottest, before)
    assert balancer.moved.copied > 0 and balancer.moved.sent == 0
    assert (read_placement(saved, num_logical=8) == placement).all()
    again = M.from_pretrained(checkpoint, expert_placement=read_placement(saved))
    assert [m.slot_experts() for m in again.moe_layers()] == placement.tolist()
    idle = ExpertBalancer(again, EplbConfig(interval=1))
    idle.rebalance()  # a window without tokens
    assert idle.rebalances == 0 and not idle.pending
    with pytest.raises(ValueError, match="needs a model built with num_physical_experts"):
        ExpertBalancer(M.from_pretrained(checkpoint), EplbConfig(interval=1))
    with pytest.raises(ValueError, match="must be >= 1"):
        EplbConfig(interval=0)


def test_a_speculative_engine_balances_the_mtp_module_s_experts_as_a_layer_after_the_model_s(
    tmp_path,
):
    """Drafting with the MTP module and balancing experts: the balancer counts the module's
    MoE layer as one more layer, replicates its hot expert there too, saves its row last, and
    a new model loads it (a model without the module refuses the extra row). The greedy tokens
    are those of the same model without balancing."""

    def skewed(**slots):
        model = M.from_preset("tiny", mtp=True, seed=3, **slots)
        for moe in model.moe_layers(mtp=True):
            moe.gate.e_score_correction_bias[5] += 10.0
        return model

    config = SchedulerConfig(num_blocks=24, block_size=16, max_model_len=256)
    prompts, params = [list(range(10, 40)), list(range(50, 61))], M.SamplingParams(max_tokens=10)
    want = Engine(skewed(), config, draft_tokens=2).generate(prompts, params)
    model, saved = skewed(num_physical_experts=10), tmp_path / "placement.json"
    engine = Engine(model, config, eplb=EplbConfig(3, save_to=saved), draft_tokens=2)
    assert engine.generate(prompts, params) == want
    balancer = engine.runner.expert_balancer
    assert balancer.layers[-1] is model.mtp.mlp
    assert len(balancer.layers) == model.args.num_moe_layers + 1
    balancer.move()
    placement, load = balancer.placement(), balancer.last_load
    assert load[-1].argmax() == 5 and load[-1].sum() > 0
    assert (placement[-1] == 5).sum() > 1  # in the default placement, once
    assert model.mtp.mlp.slot_experts() == placement[-1].tolist()
    loaded = read_placement(saved, num_logical=8)
    assert (loaded == placement).all()
    again = M.from_preset("tiny", mtp=True, expert_placement=loaded)
    assert [m.slot_experts() for m in again.moe_layers(mtp=True)] == placement.tolist()
    rows = model.args.num_moe_layers
    with pytest.raises(
        ValueError, match=rf"a row per MoE layer \({rows}\), got shape \({rows + 1}, 10\)"
    ):
        M.from_preset("tiny", expert_placement=loaded)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "is not an expert placement file"),
        ('{"num_logical_experts": 4}', "is not an expert placement file"),
        ('{"num_logical_experts": 4, "physical_to_logical": [[0, 1, 2, 3], [0, 1]]}', "equal rows"),
        ('{"num_logical_experts": 4, "physical_to_logical": [[0, 1, 2, 2.5]]}', "integers"),
        ('{"num_logical_experts": 4, "physical_to_logical": [[0, 1, 2, 2]]}', "missing \\[3\\]"),
        ('{"num_logical_experts": 4, "physical_to_logical": [[0, 1, 2, 3, 4]]}', "nothing else"),
        ('{"num_logical_experts": 3, "physical_to_logical": [[0, 1, 2]]}', "model routes to 4"),
    ],
)
def test_bad_placement_files_are_named(tmp_path, text, message):
    path = tmp_path / "placement.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_placement(path, num_logical=4)


def test_a_placement_file_round_trips(tmp_path):
    table = np.array([[3, 0, 1, 2, 0], [0, 1, 2, 3, 3]])
    write_placement(tmp_path / "p.json", table, 4)
    assert (read_placement(tmp_path / "p.json", 4) == table).all()
    assert not (tmp_path / "p.json.partial").exists()


@pytest.mark.parametrize("source", ["checkpoint", "seed"])
def test_survivors_take_the_lost_ranks_experts(checkpoint, source):
    run_ranks(3, SCENARIOS, "survivors_take_the_lost_ranks_experts", checkpoint, source, limit=300)


def test_moves_leave_empty_slots_and_reload_experts_no_slot_holds():
    # two survivors of 3 slots each, a fourth empty (-1); expert 6 was on a lost rank only
    kept = [0, 1, 2, -1, 3, 4, 5, -1]
    new = [0, 1, 2, 6, 3, 4, 5, 6]
    assert plan_moves(kept, new, ranks=2, reload=True) == [Move(3, None), Move(7, None)]
    with pytest.raises(ValueError, match="expert 6 has no slot"):
        plan_moves(kept, new, ranks=2)
