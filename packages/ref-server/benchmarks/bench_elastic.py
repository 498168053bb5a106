"""A decode rank lost mid-stream on the CPU: how long until the instance serves again, and how
many requests it loses, elastic (`--elastic`) or restarted whole by the supervisor; or, with
`--layouts`, the expert copies an elastic instance moves when it loses a rank at DeepSeek's
layouts, computed from the placement (no server runs).

    python benchmarks/bench_elastic.py [--ranks 2,4] [--modes elastic,restart]
                                       [--streams-per-rank 3] [--max-tokens 200] [--json PATH]
    python benchmarks/bench_elastic.py --layouts ep32,ep144 [--zipf 1.0] [--seed 0] [--json PATH]

For each rank count R and mode: `serve --role all --ranks R` on loopback (the tiny preset on
the CPU, a prefill and a decode instance of R ranks, health checked every 0.25 s); R x
`--streams-per-rank` greedy requests of `--max-tokens` stream at once; once every decode rank
runs some, the last decode rank's process is killed (SIGKILL). Then:

- lost / kept: the streams that ended UNAVAILABLE / completed (elastic: the killed rank's are
  lost; restarted: every rank's).
- streams resume: from the kill to the first token any kept stream got after it (elastic).
- new request served: from the kill until a request of 4 tokens sent after it completes (sent
  again while it fails: one the router sends to the dead rank before its health checks drop
  it fails at once, and with the whole instance down the router has no decode instance).

The goal is serving again within 10 s of the loss on the CPU (2 s on a GPU). On a shared
machine the figures move with its load: the table says the load average.

`--layouts`: DeepSeek-V3 (the `v3` preset, FP8 experts) at prefill EP32 and decode EP144 (288
expert slots; 8 GPUs a node), each rank lost in turn. The survivors' new placement is the one
`serve --elastic` computes (`regroup_placement`) and its copies are `plan_moves`'; each copy
comes from a slot of the same GPU, a survivor of the same node (NVLink), one of another node
(RDMA) or the checkpoint. Two loads: "even" (the default placement, no EPLB) and "zipf"
(EPLB's placement of Zipf(--zipf) loads, each layer's shuffled, by which the survivors are
placed again). The time is the bytes at the link rates below (published or assumed, not
measured), layer after layer as `regroup_experts` moves them: per layer the busiest GPU's
NVLink or RDMA direction, whichever is slower, then its checkpoint reads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import torch

from ref_server.balance import rebalance_experts
from ref_server.client import Client
from ref_server.model import PRESETS
from ref_server.model.expert_location import default_placement
from ref_server.model.expert_rebalance import expert_tensors, plan_moves, regroup_placement
from ref_server.model.fp8 import FP8Experts
from ref_server.repro import published
from ref_server.repro.run import zipf_loads
from ref_server.repro.shapes import DECODE_EP144, PREFILL_EP32
from ref_server.repro.terms import Term
from ref_server.services.config import ServeConfig
from ref_server.services.deployment import Deployment, free_port

GOAL_S = 10.0
LAYOUTS = {"ep32": PREFILL_EP32, "ep144": DECODE_EP144}
SOURCES = ("local", "nvlink", "rdma", "checkpoint")  # where a survivor's new copy comes from
HOST_TO_GPU = Term(
    "host_to_gpu",
    25e9,
    "B/s",
    "assumed",
    "a checkpoint read from the page cache over PCIe 5 x16 (64 GB/s peak); from disk, slower",
)
RATES = {"nvlink": published.H800_NVLINK, "rdma": published.CX7_RDMA, "checkpoint": HOST_TO_GPU}


def measure(ranks: int, elastic: bool, streams_per_rank: int, max_tokens: int) -> dict:
    config = ServeConfig(
        port=free_port(),
        http_port=0,
        preset="tiny",
        device="cpu",
        num_blocks=256,
        block_size=16,
        max_model_len=512,
        health_interval_s=0.25,
        ranks=ranks,
        elastic=elastic,
        failure_timeout_s=10,
        log_level="error",
    )
    deployment = Deployment(config, startup_timeout=600)
    try:
        with Client(deployment.address) as client:
            return _lose_a_rank(deployment, client, ranks * streams_per_rank, max_tokens)
    finally:
        deployment.stop()


def _lose_a_rank(deployment: Deployment, client: Client, streams: int, max_tokens: int) -> dict:
    times: dict[int, list[float]] = {i: [] for i in range(streams)}
    ends: dict[int, str] = {}

    def stream(i: int) -> None:
        prompt = list(range(3 + i, 20 + i))

        def arrived(chunk, i=i):
            times[i].append(time.monotonic())

        try:
            client.generate(
                prompt, temperature=0, max_tokens=max_tokens, timeout=300, on_chunk=arrived
            )
            ends[i] = "kept"
        except grpc.RpcError as error:
            ends[i] = error.code().name

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 300
    while not all(w.load.running for w in client.server_info().workers if w.role == "decode"):
        if time.monotonic() > deadline:
            raise RuntimeError("the decode ranks did not all get requests within 300 s")
        time.sleep(0.1)
    victim = deployment.addresses("decode")[-1]
    deployment.children[victim].kill()
    killed = time.monotonic()
    served = _served_after(client, killed)
    for thread in threads:
        thread.join(timeout=600)
    resumed = [t for i in ends if ends[i] == "kept" for t in times[i] if t > killed]
    return dict(
        streams=streams,
        lost=sum(end != "kept" for end in ends.values()),
        kept=sum(end == "kept" for end in ends.values()),
        errors=sorted({end for end in ends.values() if end != "kept"}),
        streams_resume_s=min(resumed) - killed if resumed else None,
        new_request_s=served,
    )


def _served_after(client: Client, since: float) -> float:
    """Seconds from `since` until a request sent after it has completed (sent again while it
    fails): its tokens after the first come from a decode instance (the first, from prefill)."""
    while True:
        try:
            client.generate([5, 6, 7], temperature=0, max_tokens=4, timeout=120)
            return time.monotonic() - since
        except grpc.RpcError:
            time.sleep(0.05)


def expert_slot_bytes(args) -> int:
    """One routed expert's bytes as an FP8 instance holds and moves it (`FP8Experts`' e4m3
    weights and fp32 128 x 128 block scales)."""
    with torch.device("meta"):
        experts = FP8Experts(1, args.hidden_size, args.moe_intermediate_size)
    return sum(t[0].numel() * t.element_size() for t in expert_tensors(experts))


def lost_rank_copies(old, gpus: int, victim: int, gpus_per_node: int, load=None):
    """The expert copies the survivors take in when rank `victim` of `gpus` (rank r on node
    r // gpus_per_node) is lost from an instance holding placement `old` (`[layers, P]`, every
    expert in a slot), placed again by `load` (`[layers, E]`; None: even) as `serve --elastic`
    places them: (received `[layers, survivors, 4]`, the copies each survivor gets from each of
    SOURCES; sent `[layers, survivors, 2]`, those it sends over NVLink and over RDMA)."""
    old = np.asarray(old)
    survivors = [r for r in range(gpus) if r != victim]
    before = old.shape[1] // gpus
    per_rank = max(before, -(-(int(old.max()) + 1) // len(survivors)))
    kept, new = regroup_placement(old, survivors, before, per_rank, load)
    per_rank = kept.shape[1] // len(survivors)
    node = np.array(survivors) // gpus_per_node
    received = np.zeros((len(old), len(survivors), len(SOURCES)), dtype=np.int64)
    sent = np.zeros((len(old), len(survivors), 2), dtype=np.int64)
    for layer in range(len(old)):
        for move in plan_moves(kept[layer], new[layer], len(survivors), reload=True):
            to = move.to // per_rank
            if move.source is None:
                received[layer, to, SOURCES.index("checkpoint")] += 1
                continue
            source = move.source // per_rank
            link = "local" if source == to else "nvlink" if node[source] == node[to] else "rdma"
            received[layer, to, SOURCES.index(link)] += 1
            if link != "local":
                sent[layer, source, SOURCES.index(link) - 1] += 1
    return received, sent


def only_on(old, gpus: int, victim: int) -> int:
    """Over the layers of placement `old` (`[layers, P]`), the experts no rank but `victim`
    holds: the fewest copies that must come from the checkpoint when it is lost."""
    old = np.asarray(old)
    per_rank = old.shape[1] // gpus
    lost = np.arange(victim * per_rank, (victim + 1) * per_rank)
    rest = np.delete(old, lost, axis=1)
    return sum(len(set(o[lost].tolist()) - set(r.tolist())) for o, r in zip(old, rest, strict=True))


def traffic(received, sent, slot_bytes: int) -> dict:
    """What a lost rank's copies (`lost_rank_copies`) move: copies by source, bytes over the
    links (NVLink, RDMA and checkpoint reads; local copies stay in a GPU's memory), the bytes
    the busiest survivor takes in, and the seconds at RATES, layer after layer."""
    copies = received.sum((0, 1))
    over_links = received[..., 1:] * slot_bytes
    nvlink = np.maximum(received[..., 1], sent[..., 0]) * slot_bytes / RATES["nvlink"].value
    rdma = np.maximum(received[..., 2], sent[..., 1]) * slot_bytes / RATES["rdma"].value
    reads = received[..., 3] * slot_bytes / RATES["checkpoint"].value
    seconds = np.maximum(nvlink, rdma).max(1) + reads.max(1)
    return dict(
        copies=int(copies.sum()),
        **{f"from_{source}": int(n) for source, n in zip(SOURCES, copies, strict=True)},
        bytes_per_layer=float(over_links.sum() / len(received)),
        bytes=int(over_links.sum()),
        busiest_survivor_bytes=int(over_links.sum((0, 2)).max()),
        seconds=float(seconds.sum()),
    )


def layout_traffic(name: str, zipf: float | None, seed: int) -> dict:
    """Every rank of DeepSeek's layout `name` lost in turn, its survivors' copies (`traffic`
    of each); zipf None: the default placement, placed again evenly; else EPLB's placement of
    Zipf(zipf) loads, by which the survivors are placed again."""
    args, point = PRESETS["v3"], LAYOUTS[name]
    gpus, slots, layers = point.gpus, point.physical_experts, args.num_moe_layers
    per_node = int(published.GPUS_PER_NODE.value)
    old = np.tile(default_placement(args.n_routed_experts, slots).numpy(), (layers, 1))
    load = None
    if zipf is not None:
        pairs = gpus * point.tokens_per_gpu * args.num_experts_per_tok
        load = zipf_loads(layers, args.n_routed_experts, pairs, zipf, seed)
        old = rebalance_experts(load, slots, args.n_group, 1, gpus, previous=old).phy2log
    # layers alike (placement and load) are placed alike: each kind is computed once
    rows = old if load is None else np.concatenate([old, load], axis=1)
    _, first, kind = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    kind = kind.reshape(-1)
    slot_bytes = expert_slot_bytes(args)
    victims = []
    for victim in range(gpus):
        received, sent = lost_rank_copies(
            old[first], gpus, victim, per_node, None if load is None else load[first]
        )
        row = traffic(received[kind], sent[kind], slot_bytes)
        victims.append(dict(lost_rank=victim, only_on_lost_rank=only_on(old, gpus, victim), **row))
    return dict(
        layout=name,
        gpus=gpus,
        nodes=gpus // per_node,
        slots=slots,
        slots_per_gpu=slots // gpus,
        moe_layers=layers,
        load="even" if zipf is None else f"zipf {zipf:g}, seed {seed}",
        expert_bytes=slot_bytes,
        victims=victims,
    )


LAYOUT_ROWS = (  # (key, what the table says, scale, format)
    ("copies", "copies moved", 1, ",g"),
    ("from_local", "  from a slot of the same GPU", 1, ",g"),
    ("from_nvlink", "  from a survivor of the node (NVLink)", 1, ",g"),
    ("from_rdma", "  from a survivor of another node (RDMA)", 1, ",g"),
    ("from_checkpoint", "  from the checkpoint", 1, ",g"),
    ("only_on_lost_rank", "experts only the lost rank held", 1, ",g"),
    ("bytes_per_layer", "GB over links, a layer", 1e-9, ".2f"),
    ("bytes", "GB over links, all layers", 1e-9, ".1f"),
    ("busiest_survivor_bytes", "GB into the busiest survivor", 1e-9, ".2f"),
    ("seconds", "seconds at the link rates", 1, ".3f"),
)


def print_layouts(documents: list[dict]) -> None:
    print("A rank lost from DeepSeek-V3 at DeepSeek's layouts: the expert copies serve --elastic "
          "moves, computed from the placement (not measured); over all MoE layers unless "
          "'a layer'; min / median / max over the lost rank")  # fmt: skip
    for doc in documents:
        print(f"\n{doc['layout']}: {doc['gpus']} GPUs on {doc['nodes']} nodes, {doc['slots']} "
              f"slots ({doc['slots_per_gpu']} a GPU), {doc['moe_layers']} MoE layers, "
              f"{doc['expert_bytes']:,} B an expert, load {doc['load']}")  # fmt: skip
        for key, label, scale, form in LAYOUT_ROWS:
            values = np.array([victim[key] for victim in doc["victims"]]) * scale
            spread = (np.min(values), np.median(values), np.max(values))
            print(f"  {label:42}" + "".join(f" {value:>10{form}}" for value in spread))
    for link, term in RATES.items():
        print(f"{link}: {term.value / 1e9:g} GB/s, {term.source}: {term.note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--modes", default="elastic,restart")
    parser.add_argument("--streams-per-rank", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument(
        "--layouts", help=f"of {', '.join(LAYOUTS)}: compute their copies instead of serving"
    )
    parser.add_argument("--zipf", type=float, default=1.0, help="--layouts' skewed load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    options = parser.parse_args()
    if options.layouts:
        compute_layouts(options)
    else:
        lose_a_rank(options)


def compute_layouts(options) -> None:
    names = options.layouts.split(",")
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; layouts: {', '.join(LAYOUTS)}")
    documents = [
        layout_traffic(n, zipf, options.seed) for n in names for zipf in (None, options.zipf)
    ]
    print_layouts(documents)
    if options.json:
        rates = {link: term.to_json() for link, term in RATES.items()}
        document = dict(computed="from the placement, not measured", rates=rates, layouts=documents)
        Path(options.json).write_text(json.dumps(document, indent=1))


def lose_a_rank(options) -> None:
    rows = []
    for ranks in [int(r) for r in options.ranks.split(",")]:
        for mode in options.modes.split(","):
            row = measure(ranks, mode == "elastic", options.streams_per_rank, options.max_tokens)
            rows.append(dict(ranks=ranks, mode=mode, load=os.getloadavg()[0], **row))
    print(f"A decode rank killed mid-stream, tiny preset on the CPU ({os.cpu_count()} cores); "
          f"goal: serving again within {GOAL_S:g} s")  # fmt: skip
    print("ranks | mode    | streams | lost | kept | streams resume (s) | new request (s) | "
          "/goal | load")  # fmt: skip
    for row in rows:
        resumed = row["streams_resume_s"]
        print(
            f"{row['ranks']:5} | {row['mode']:7} | {row['streams']:7} | {row['lost']:4} | "
            f"{row['kept']:4} | {'-' if resumed is None else f'{resumed:.1f}':>18} | "
            f"{row['new_request_s']:15.1f} | {row['new_request_s'] / GOAL_S:5.2f} | "
            f"{row['load']:.1f}"
        )
    if options.json:
        document = dict(machine=platform.node(), cpus=os.cpu_count(), goal_s=GOAL_S, rows=rows)
        Path(options.json).write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
