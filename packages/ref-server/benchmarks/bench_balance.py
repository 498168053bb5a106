"""Expert placement (`ref_server.balance`) on DeepSeek's layouts under Zipf loads: balancedness
next to round-robin, and the slots a rebalance moves after the loads drift, with and without
`keep_in_place`.

    python benchmarks/bench_balance.py [--layers 8] [--drift 0.1] [--seed 0] [--json PATH]

CPU only, a few seconds. Layouts (DeepSeek's deployment): prefill EP 32 with 9 slots a GPU
(4 nodes of 8 GPUs), decode EP 144 with 2 slots a GPU (18 nodes; 8 expert groups do not divide
among them, so the global policy); 256 logical experts in 8 groups, 288 slots. Loads: expert
of rank r (a random order per layer) gets 1e5 / r^s tokens, s in 1.0, 1.25, 1.5. Balancedness
is the mean over the max of the GPUs' loads, averaged over the layers. Drift: every load times
(1 + drift x a standard normal), clipped at 0; "moved" is the fraction of slots whose expert
changes from the first placement. SGLang's published throughput gains from EPLB (96 H100s,
prefill 1.49x, decode 2.54x) are printed as published figures beside: they measure tokens/s,
not balancedness, and come from another setup.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from ref_server.balance import balancedness, rebalance_experts, round_robin

LAYOUTS = {"prefill EP32": (32, 4), "decode EP144": (144, 18)}  # gpus, nodes
LOGICAL, REPLICAS, GROUPS = 256, 288, 8
EXPONENTS = (1.0, 1.25, 1.5)
PUBLISHED_GAIN = {"prefill EP32": 1.49, "decode EP144": 2.54}  # SGLang, tokens/s


def zipf_loads(rng: np.random.Generator, layers: int, exponent: float) -> np.ndarray:
    ranks = np.argsort(rng.random((layers, LOGICAL)), axis=1) + 1
    return 1e5 / ranks.astype(np.float64) ** exponent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--drift", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    options = parser.parse_args()
    rng = np.random.default_rng(options.seed)
    print(
        f"{'layout':<13} {'zipf':>4} {'round-robin':>11} {'eplb':>5} {'gain':>5} "
        f"{'moved':>6} {'kept':>5}  published throughput gain (SGLang)"
    )
    rows = []
    for name, (gpus, nodes) in LAYOUTS.items():
        for exponent in EXPONENTS:
            weight = zipf_loads(rng, options.layers, exponent)
            first = rebalance_experts(weight, REPLICAS, GROUPS, nodes, gpus)
            placed = balancedness(weight, first.phy2log, first.logcnt, gpus).mean()
            baseline = balancedness(weight, *round_robin(LOGICAL, REPLICAS, len(weight)), gpus)
            noise = 1 + options.drift * rng.standard_normal(weight.shape)
            drifted = np.clip(weight * noise, 0, None)
            plain = rebalance_experts(drifted, REPLICAS, GROUPS, nodes, gpus)
            kept = rebalance_experts(drifted, REPLICAS, GROUPS, nodes, gpus, first.phy2log)
            moved = float((plain.phy2log != first.phy2log).mean())
            row = dict(layout=name, gpus=gpus, nodes=nodes, zipf=exponent)
            row |= dict(round_robin=float(baseline.mean()), eplb=float(placed))
            row |= dict(moved=moved, moved_kept=float(kept.moved.mean()))
            rows.append(row)
            print(
                f"{name:<13} {exponent:>4} {row['round_robin']:>11.3f} {placed:>5.3f} "
                f"{placed / row['round_robin']:>5.2f} {moved:>6.2f} {row['moved_kept']:>5.2f}"
                f"  {PUBLISHED_GAIN[name]}x",
                flush=True,
            )
    if options.json:
        with open(options.json, "w") as f:
            json.dump(vars(options) | dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
