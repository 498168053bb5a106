"""Balancedness: the mean over the max of the GPUs' routed loads (1: perfectly even). The
slowest GPU sets every MoE layer's pace, so the projection divides routed-expert and
communication times by it."""

from __future__ import annotations

import numpy as np

from ref_server.balance import balancedness, rebalance_experts
from ref_server.repro.terms import Term

PERFECT = Term(
    "balancedness",
    1.0,
    "1",
    "assumed",
    "perfectly even routing, as profile-data simulated it: compare only with profile-data",
)


def check(term: Term) -> Term:
    if not 0 < term.value <= 1:
        raise ValueError(f"{term.name} must be in (0, 1], got {term.value:g}")
    return term


def from_loads(
    loads, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, source: str, note: str
) -> Term:
    """EPLB (`ref_server.balance.rebalance_experts`) placed over `loads` `[layers, experts]`
    (tokens routed to each expert), its balancedness over the layers: their harmonic mean, since
    the step takes the sum over layers of time / balancedness. source: "measured" for loads
    recorded while serving, "assumed" for synthetic ones; note: which."""
    placement = rebalance_experts(loads, num_replicas, num_groups, num_nodes, num_gpus)
    per_layer = balancedness(loads, placement.phy2log, placement.logcnt, num_gpus)
    value = float(len(per_layer) / np.sum(1 / per_layer))
    layout = f"EPLB over {len(per_layer)} layers, {num_replicas} slots on {num_gpus} GPUs"
    return check(Term("balancedness", value, "1", source, f"{layout}; {note}"))
