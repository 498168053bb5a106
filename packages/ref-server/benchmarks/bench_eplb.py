"""The MoE layer's expert time with and without EPLB under skewed routing, on DeepSeek's
layouts, from each rank's expert GEMMs timed on this GPU; and what a live re-placement costs.

    python benchmarks/bench_eplb.py [--zipf 1.0,1.25,1.5] [--reps 10] [--json PATH]

CUDA only. One layer of V3's routed experts (hidden 7168, intermediate 2048, 256 experts, 8 a
token, bf16) over the ranks of DeepSeek's layouts: prefill EP32 with 9 slots a GPU and 4096
tokens a GPU, decode EP144 with 2 slots a GPU and 128 tokens a GPU (288 slots). A token picks
8 distinct experts with probabilities 1/rank^s (a random order of the experts). EPLB places the
slots for one window's counts (`rebalance_experts`, as an instance does); a fresh batch of the
same law is then timed under that placement and under the default one (slot p holds expert
p mod 256: the first 32 experts twice, the others once). Each choice goes to a replica by the
model's rule (`ExpertLocation.to_physical`); each rank's rows, grouped by slot, run through
the experts' grouped GEMMs and SwiGLU (`Experts.mlp`, the prefill and eager layout) as CUDA
graph replays, one rank after another. Ranks run at once in a deployment and the exchange
waits for the slowest, so the layer's expert time is the slowest rank's; the mean over ranks
is what a perfect balance would give. Not in the figures: the exchange, attention, several
GPUs at once (this is one GPU timing each rank's share in turn).

Re-placement: one rank's layer of V3 experts (9 slots), every slot but one taking another
expert (local copies, `move_layer`), timed whole (planning included) against the same run's
copy ceiling. SGLang's published gains from EPLB (96 H100s, tokens/s: prefill 1.49x, decode
2.54x) and ATOM's +16.7% for re-arrangement alone are printed beside as published figures,
from another setup: they include the exchange and everything else a step does.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import numpy as np
import torch
from bench_expert_gemm import ceilings, graph_ms  # this folder's: the same timing and ceilings

import ref_server.model as M
from ref_server.balance import balancedness, rebalance_experts
from ref_server.model.expert_location import ExpertLocation, default_placement
from ref_server.model.expert_rebalance import move_layer
from ref_server.model.moe import Experts, MoE

HIDDEN, INTER, EXPERTS, TOP_K, GROUPS = 7168, 2048, 256, 8, 8
SLOTS = 288
LAYOUTS = {  # ranks, nodes, tokens a rank
    "prefill EP32": (32, 4, 4096),
    "decode EP144": (144, 18, 128),
}
PUBLISHED_GAIN = {"prefill EP32": 1.49, "decode EP144": 2.54}  # SGLang, tokens/s
ATOM_REARRANGEMENT = 1.167  # ATOM, re-arrangement only (no redundant experts)


def routing(g: torch.Generator, tokens: int, order: torch.Tensor, exponent: float) -> torch.Tensor:
    """`[tokens, 8]` distinct experts per token, expert order[r] drawn with weight 1/(r+1)^s."""
    weight = torch.zeros(EXPERTS, dtype=torch.float64)
    weight[order] = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float64) ** exponent
    return torch.multinomial(weight.expand(tokens, -1), TOP_K, generator=g)


def rows_per_slot(ids: torch.Tensor, phy2log: np.ndarray) -> torch.Tensor:
    """`[SLOTS]`: the rows each slot gets, replicas chosen as the model chooses."""
    location = ExpertLocation(EXPERTS, SLOTS)
    location.place(torch.from_numpy(phy2log))
    slots = location.to_physical(ids)
    return torch.bincount(slots.flatten(), minlength=SLOTS)


def expert_ms(experts: Experts, counts: list[int], reps: int) -> float:
    """One rank's rows (counts per local slot) through its experts' grouped GEMMs."""
    rows = sum(counts)
    if rows == 0:
        return 0.0
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor(counts, device="cuda").cumsum(0).int()
    return graph_ms(lambda: experts.mlp(x, offsets), reps)


def layer_figures(name: str, exponent: float, options, flops_ceiling: float) -> dict:
    ranks, nodes, per_rank = LAYOUTS[name]
    g = torch.Generator().manual_seed(options.seed)
    order = torch.randperm(EXPERTS, generator=g)
    window = routing(g, ranks * per_rank, order, exponent)
    load = torch.bincount(window.flatten(), minlength=EXPERTS)[None].numpy()
    eplb = rebalance_experts(load, SLOTS, GROUPS, nodes, ranks).phy2log[0]
    default = default_placement(EXPERTS, SLOTS).numpy()
    batch = routing(g, ranks * per_rank, order, exponent)
    slots = SLOTS // ranks
    experts = Experts(slots, HIDDEN, INTER).to("cuda", torch.bfloat16)
    for t in (experts.gate_up_proj, experts.down_proj):
        t.data.normal_(0, 0.02)
    batch_load = torch.bincount(batch.flatten(), minlength=EXPERTS)[None].numpy()
    row = dict(layout=name, ranks=ranks, slots_per_rank=slots, tokens_per_rank=per_rank)
    row["zipf"] = exponent
    for label, phy2log in (("default", default), ("eplb", eplb)):
        counts = rows_per_slot(batch, phy2log).view(ranks, slots).tolist()
        times = [expert_ms(experts, c, options.reps) for c in counts]
        slowest = int(np.argmax(times))
        flops = 2 * sum(counts[slowest]) * (2 * INTER * HIDDEN + HIDDEN * INTER)
        logcnt = np.bincount(phy2log, minlength=EXPERTS)[None]
        row[label] = dict(
            balancedness=float(balancedness(batch_load, phy2log[None], logcnt, ranks)[0]),
            max_ms=max(times),
            mean_ms=statistics.fmean(times),
            slowest_rows=sum(counts[slowest]),
            slowest_matmul_share=flops / (max(times) * 1e-3) / flops_ceiling,
        )
    row["gain"] = row["default"]["max_ms"] / row["eplb"]["max_ms"]
    return row


def replacement_figures(options, copy_ceiling: float) -> dict:
    """One rank's V3 layer of 9 slots, slot p to expert (p - 1) mod 9's weights."""
    args = replace(M.PRESETS["v3"], n_routed_experts=8, n_group=1, topk_group=1)
    with torch.device("cuda"):
        moe = MoE(args, num_physical=9).to(torch.bfloat16)
    moe.location.place(default_placement(8, 9))
    times = []
    for _ in range(options.reps):
        new = moe.location.physical_to_logical.cpu().roll(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        moved = move_layer(moe, new)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    return dict(bytes=moved.copied, ms=ms, copy_share=2 * moved.copied / (ms * 1e-3) / copy_ceiling)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--zipf", default="1.0,1.25,1.5")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_eplb.py needs a CUDA GPU")
    flops_ceiling, copy_ceiling = ceilings(options.reps)
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {flops_ceiling / 1e12:.0f} TFLOP/s, "
          f"copy {copy_ceiling / 1e12:.2f} TB/s (this run)")  # fmt: skip
    print(
        f"{'layout':<13} {'zipf':>4} {'balanced d/e':>12} {'slowest ms d/e':>15} "
        f"{'mean ms':>7} {'gain':>5} {'slowest/matmul':>14}  published (SGLang, tokens/s)"
    )
    rows = []
    for name in LAYOUTS:
        for exponent in (float(s) for s in options.zipf.split(",")):
            row = layer_figures(name, exponent, options, flops_ceiling)
            rows.append(row)
            d, e = row["default"], row["eplb"]
            print(
                f"{name:<13} {exponent:>4} {d['balancedness']:>5.2f}/{e['balancedness']:<6.2f} "
                f"{d['max_ms']:>7.3f}/{e['max_ms']:<7.3f} {e['mean_ms']:>7.3f} "
                f"{row['gain']:>5.2f} {d['slowest_matmul_share']:>6.2f}/"
                f"{e['slowest_matmul_share']:<7.2f}  {PUBLISHED_GAIN[name]}x",
                flush=True,
            )
    move = replacement_figures(options, copy_ceiling)
    print(
        f"re-placement, one rank's 9 V3 slots (8 changed, local): {move['bytes'] / 1e9:.2f} GB "
        f"in {move['ms']:.1f} ms, {move['copy_share']:.2f} of the copy ceiling; "
        f"ATOM's re-arrangement-only gain (published): +{(ATOM_REARRANGEMENT - 1) * 100:.1f}%"
    )
    if options.json:
        ceiling = dict(matmul_flops=flops_ceiling, copy_bytes_per_s=copy_ceiling)
        with open(options.json, "w") as f:
            json.dump(vars(options) | ceiling | dict(rows=rows, replacement=move), f, indent=1)


if __name__ == "__main__":
    main()
