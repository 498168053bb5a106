"""Load balancing as pure functions over load snapshots (no torch; I/O only in placement_file).

`experts`: DeepSeek's expert-parallel load balancer (EPLB): replicate hot experts and place
the replicas so that every GPU gets a similar share of the routed tokens.

`instances`: which prefill and decode instance the router sends a request to (SGLang's
cache_aware rule for prefill); `prefix_index`: the router's guess of each prefill instance's
cached pages, that rule's input; `placement_file`: a saved expert placement.
"""

from ref_server.balance.experts import (
    Placement,
    balancedness,
    keep_in_place,
    rebalance_experts,
    round_robin,
)
from ref_server.balance.instances import (
    InstanceLoad,
    PrefillPolicy,
    imbalanced,
    pick_decode,
    pick_prefill,
)
from ref_server.balance.placement_file import read_placement, write_placement
from ref_server.balance.prefix_index import PrefixIndex

__all__ = [
    "InstanceLoad",
    "Placement",
    "PrefillPolicy",
    "PrefixIndex",
    "balancedness",
    "imbalanced",
    "keep_in_place",
    "pick_decode",
    "pick_prefill",
    "read_placement",
    "rebalance_experts",
    "round_robin",
    "write_placement",
]
