"""Load balancing as pure functions over load snapshots (no torch, no I/O).

`experts`: DeepSeek's expert-parallel load balancer (EPLB): replicate hot experts and place
the replicas so that every GPU gets a similar share of the routed tokens.
"""

from ref_server.balance.experts import (
    Placement,
    balancedness,
    keep_in_place,
    rebalance_experts,
    round_robin,
)

__all__ = ["Placement", "balancedness", "keep_in_place", "rebalance_experts", "round_robin"]
