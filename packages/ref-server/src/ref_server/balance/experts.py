"""Expert placement for expert parallelism: DeepSeek's EPLB algorithm, in numpy.

Given each MoE layer's load per logical expert (tokens routed to it over a window),
`rebalance_experts` chooses how many replicas each expert gets and which GPU holds each
replica ("physical expert"), so that the GPUs' loads are as even as a greedy packing makes
them. Two policies, as DeepSeek publishes them:

- hierarchical (when the expert groups divide evenly among the nodes): whole groups are packed
  onto nodes first (the router's group limit then keeps a token's experts within few nodes),
  replicas are made within each node, then packed onto the node's GPUs;
- global (otherwise): replicas over all experts, packed onto all GPUs.

Each packing takes the items heaviest first (ties: the lower index first) and puts each on
the lightest pack that still has room (ties: the lower pack), with every pack taking the same
number of items; each replica goes, one at a time, to the expert whose load per replica is
highest (ties: the lower expert). Loads are float32 and sums run in float32, in that order, so
that the placements are those of the published implementation (the tests hold them to its
outputs). Nothing here guarantees two replicas of an expert land on different GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Placement:
    """phy2log int64 `[layers, physical]`: the logical expert of each physical slot (slot p on
    GPU p // (physical / gpus)); log2phy int64 `[layers, logical, max replicas]`: each logical
    expert's slots, -1 past its count; logcnt int64 `[layers, logical]`: its replica count;
    moved float64 `[layers]`: the fraction of slots whose expert changed from the previous
    placement (None without one)."""

    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray
    moved: np.ndarray | None = None


def rebalance_experts(
    weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, previous=None
) -> Placement:
    """weight `[layers, logical]` (non-negative loads, any real dtype; taken as float32);
    num_replicas physical experts in all, a multiple of num_gpus and at least the logical
    experts; num_groups the router's expert groups; num_gpus a multiple of num_nodes. The
    hierarchical policy where num_groups divides evenly among num_nodes, the global one
    otherwise. previous: the phy2log `[layers, num_replicas]` in place now, to move as little
    as the new placement allows (`keep_in_place`). ValueError naming the numbers that do not
    fit."""
    weight = np.asarray(weight)
    if weight.ndim != 2:
        raise ValueError(f"weight must be [layers, logical experts], got shape {weight.shape}")
    if not np.issubdtype(weight.dtype, np.number) or not np.isfinite(weight).all():
        raise ValueError("weight must hold finite numbers")
    if (weight < 0).any():
        raise ValueError("weight must be non-negative (tokens routed to each expert)")
    layers, logical = weight.shape
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if num_nodes < 1 or num_gpus < 1 or num_gpus % num_nodes:
        raise ValueError(
            f"num_gpus ({num_gpus}) must be a positive multiple of num_nodes ({num_nodes})"
        )
    if num_replicas % num_gpus:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus})"
        )
    if num_replicas < logical:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be at least the {logical} logical experts"
        )
    if logical % num_groups:
        raise ValueError(f"the {logical} logical experts do not split into {num_groups} groups")
    nodes = num_nodes  # the machine's, where keep_in_place moves GPUs within
    if num_groups % num_nodes:
        num_groups = num_nodes = 1  # the global policy

    weight = weight.astype(np.float32)
    phy2log = np.empty((layers, num_replicas), dtype=np.int64)
    rank = np.empty((layers, num_replicas), dtype=np.int64)
    logcnt = np.empty((layers, logical), dtype=np.int64)
    for layer in range(layers):
        phy2log[layer], rank[layer], logcnt[layer] = _hierarchical(
            weight[layer], num_replicas, num_groups, num_nodes, num_gpus
        )
    if previous is None:
        return Placement(phy2log, _log2phy(phy2log, rank, logcnt), logcnt)
    previous = np.asarray(previous)
    if previous.shape != phy2log.shape:
        raise ValueError(f"previous must be phy2log's shape {phy2log.shape}, got {previous.shape}")
    return keep_in_place(phy2log, logcnt, previous, num_gpus, nodes)


def _log2phy(phy2log, rank, logcnt) -> np.ndarray:
    layers, physical = phy2log.shape
    log2phy = np.full((layers, logcnt.shape[1], int(logcnt.max())), -1, dtype=np.int64)
    slots = np.broadcast_to(np.arange(physical), (layers, physical))
    log2phy[np.arange(layers)[:, None], phy2log, rank] = slots
    return log2phy


def keep_in_place(phy2log, logcnt, previous, num_gpus: int, num_nodes: int) -> Placement:
    """The placement phy2log `[layers, physical]` (with its logcnt) renumbered to move the
    fewest experts from `previous` (`[layers, physical]`, the slots' experts now): within each
    node, its GPUs' contents are matched to its GPUs greedily, most experts in common first;
    within each GPU, an expert that a slot holds already stays in that slot. What each GPU
    holds, and so every GPU's load, the node of every group and the balancedness, are the
    placement's; only which GPU of a node and which slot of a GPU change."""
    phy2log, previous = np.asarray(phy2log), np.asarray(previous)
    layers, physical = phy2log.shape
    per_gpu, gpus_per_node = physical // num_gpus, num_gpus // num_nodes
    kept = np.empty_like(phy2log)
    for layer in range(layers):
        new = phy2log[layer].reshape(num_gpus, per_gpu)
        old = previous[layer].reshape(num_gpus, per_gpu)
        for node in range(num_nodes):
            gpus = range(node * gpus_per_node, (node + 1) * gpus_per_node)
            for source, target in _match_gpus(new, old, gpus):
                kept[layer, target * per_gpu : (target + 1) * per_gpu] = _keep_slots(
                    new[source], old[target]
                )
    # replica ranks in slot order
    rank = np.zeros_like(kept)
    for layer in range(layers):
        seen = np.zeros(logcnt.shape[1], dtype=np.int64)
        for slot, expert in enumerate(kept[layer]):
            rank[layer, slot], seen[expert] = seen[expert], seen[expert] + 1
    moved = (kept != previous).mean(-1)
    return Placement(kept, _log2phy(kept, rank, logcnt), np.asarray(logcnt), moved)


def _match_gpus(new, old, gpus) -> list[tuple[int, int]]:
    """(new GPU, position) pairs over one node's GPUs, the pairs with the most experts in common
    first (ties: lower GPUs first)."""
    gpus = np.asarray(gpus)
    experts = int(max(new.max(), old.max())) + 1
    common = _in_common(_expert_counts(new[gpus], experts), _expert_counts(old[gpus], experts))
    order = np.unravel_index(np.argsort(-common, axis=None, kind="stable"), common.shape)
    pairs, used_new, used_old = [], set(), set()
    for a, b in zip(gpus[order[0]].tolist(), gpus[order[1]].tolist(), strict=True):
        if a not in used_new and b not in used_old:
            pairs.append((a, b))
            used_new.add(a)
            used_old.add(b)
            if len(pairs) == len(gpus):
                break
    return pairs


def _expert_counts(slots: np.ndarray, experts: int) -> np.ndarray:
    """`[GPUs, experts]`: how many slots of each GPU hold each expert (-1, empty: none)."""
    counts = np.zeros((len(slots), experts), dtype=np.int32)
    rows = np.broadcast_to(np.arange(len(slots))[:, None], slots.shape)
    held = slots >= 0
    np.add.at(counts, (rows[held], slots[held]), 1)
    return counts


def _in_common(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`[GPUs of a, GPUs of b]`: how many experts each pair of GPUs' slot lists share, counting
    replicas (a, b: `_expert_counts`)."""
    return np.minimum(a[:, None, :], b[None, :, :]).sum(-1)


def _keep_slots(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """new's experts (one GPU's) in the order that leaves the most of old's slots as they are."""
    left = list(new)
    slots = [-1] * len(old)
    for slot, expert in enumerate(old):
        if expert in left:
            slots[slot] = expert
            left.remove(expert)
    rest = iter(left)
    return np.array([expert if expert >= 0 else next(rest) for expert in slots], dtype=np.int64)


def _hierarchical(weight, physical: int, groups: int, nodes: int, gpus: int):
    """One layer: (phy2log `[physical]`, each slot's replica rank, logcnt `[logical]`)."""
    logical = len(weight)
    group_size = logical // groups
    group_loads = weight.reshape(groups, group_size).sum(-1, dtype=np.float32)
    node, rank_in_node = _pack(group_loads, nodes)
    # experts renumbered node by node ("node-major"): mlog = node's first + rank within it
    group_first = (node * (groups // nodes) + rank_in_node) * group_size
    log2mlog = (group_first[:, None] + np.arange(group_size)).reshape(-1)
    mlog2log = _inverse(log2mlog)

    per_node, slots_per_node, slots_per_gpu = logical // nodes, physical // nodes, physical // gpus
    slot2mlog, slot_rank, mlogcnt = [], [], []
    for n in range(nodes):
        loads = weight[mlog2log[n * per_node : (n + 1) * per_node]]
        replica_of, replica_rank, count = _replicate(loads, slots_per_node)
        per_replica = (loads / count.astype(np.float32))[replica_of]
        gpu, rank_in_gpu = _pack(per_replica, gpus // nodes)
        order = _inverse(gpu * slots_per_gpu + rank_in_gpu)  # slot on the node -> replica
        slot2mlog.append(replica_of[order] + n * per_node)
        slot_rank.append(replica_rank[order])
        mlogcnt.append(count)
    phy2log = mlog2log[np.concatenate(slot2mlog)]
    return phy2log, np.concatenate(slot_rank), np.concatenate(mlogcnt)[log2mlog]


def _pack(weights: np.ndarray, packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Items (float32 `[n]`) into `packs` packs of n / packs items each, heaviest first onto the
    lightest pack with room: (each item's pack, its rank within the pack)."""
    n = len(weights)
    per_pack = n // packs
    if per_pack == 1:
        return np.arange(n), np.zeros(n, dtype=np.int64)
    pack_of = np.empty(n, dtype=np.int64)
    rank_in_pack = np.empty(n, dtype=np.int64)
    loads = np.zeros(packs, dtype=np.float32)
    counts = np.zeros(packs, dtype=np.int64)
    for item in np.argsort(-weights, kind="stable"):
        pack = min((p for p in range(packs) if counts[p] < per_pack), key=loads.__getitem__)
        pack_of[item], rank_in_pack[item] = pack, counts[pack]
        loads[pack] += weights[item]
        counts[pack] += 1
    return pack_of, rank_in_pack


def _replicate(weights: np.ndarray, physical: int):
    """Experts (float32 loads `[n]`) into `physical` replicas, each extra one to the expert with
    the most load per replica: (each replica's expert, its rank among the expert's replicas,
    each expert's count). Replica i < n is expert i."""
    n = len(weights)
    replica_of = np.concatenate([np.arange(n), np.zeros(physical - n, dtype=np.int64)])
    rank = np.zeros(physical, dtype=np.int64)
    count = np.ones(n, dtype=np.int64)
    for replica in range(n, physical):
        expert = int(np.argmax(weights / count.astype(np.float32)))
        replica_of[replica], rank[replica] = expert, count[expert]
        count[expert] += 1
    return replica_of, rank, count


def _inverse(permutation: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(permutation)
    inverse[permutation] = np.arange(len(permutation))
    return inverse


def balancedness(weight, phy2log, logcnt, num_gpus: int) -> np.ndarray:
    """Per layer, the mean over the max of the GPUs' loads (1: perfectly even), an expert's load
    split evenly over its replicas: weight `[layers, logical]`, phy2log `[layers, physical]`,
    logcnt `[layers, logical]`; float64 `[layers]`."""
    weight, phy2log, logcnt = (np.asarray(a) for a in (weight, phy2log, logcnt))
    per_replica = weight.astype(np.float64) / logcnt
    slot_loads = np.take_along_axis(per_replica, phy2log, axis=1)
    gpu_loads = slot_loads.reshape(len(weight), num_gpus, -1).sum(-1)
    peak = gpu_loads.max(-1)
    return np.where(peak > 0, gpu_loads.mean(-1) / np.where(peak > 0, peak, 1), 1.0)


def round_robin(num_logical: int, num_replicas: int, layers: int) -> tuple[np.ndarray, np.ndarray]:
    """The baseline without balancing: slot p holds expert p mod num_logical, so the first
    num_replicas - num_logical experts get a second replica. (phy2log, logcnt)."""
    phy2log = np.arange(num_replicas) % num_logical
    logcnt = np.bincount(phy2log, minlength=num_logical)
    return np.tile(phy2log, (layers, 1)), np.tile(logcnt, (layers, 1))
