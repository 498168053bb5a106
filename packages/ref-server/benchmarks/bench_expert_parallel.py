"""The model's expert-parallel path: one instance of W ranks, checked against one process, then
its prefill and decode tokens/s for a fixed batch.

    python benchmarks/bench_expert_parallel.py [--world 4] [--preset v2-lite] [--layers N]
        [--batch 32] [--prompt 512] [--steps 10] [--gpu-per-rank] [--json results.json]

Each rank holds 1/W of the routed experts and runs `--batch` sequences of its own
(data-parallel attention); every MoE layer moves tokens through ep_comm (the cuda backend on
GPUs). First, correctness: rank 0 also builds one process holding every expert, and the two
give rank 0's prefill and first decode logits within bf16 rounding (the run fails otherwise;
the greedy agreement is printed). Then a cached prefill step of `--prompt` tokens per
sequence and `--steps` decode steps, each timed on every rank between barriers (a step is a
collective), median over repetitions; the instance's tok/s is W x batch x tokens over the
slowest rank's median. Decode runs eagerly (expert-parallel steps wait on the host). By
default all ranks share GPU 0 (they time-slice it); --gpu-per-rank puts rank r on GPU r.
The roofline and the single-process figures are bench_model.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
import torch.distributed as dist

import ref_server.model as M
from ep_comm.testing import run_ranks
from ref_server.model import StepBatch

TOLERANCE = 3e-2  # of the logits' largest magnitude: bf16 rounding, sums in another order


def preset_args(preset: str, layers: int) -> M.ModelArgs:
    args = M.PRESETS[preset]
    if layers:
        dense = min(args.first_k_dense_replace, layers)
        args = dataclasses.replace(args, num_hidden_layers=layers, first_k_dense_replace=dense)
    return args


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    """Median seconds of fn() on this rank, every repetition started together on all ranks."""
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def rank_main(rank, world, group, preset, layers, batch, prompt, steps, reps):
    args = preset_args(preset, layers)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = M.from_args(args, seed=0, dtype=dtype, device=device, group=group)
    g = torch.Generator().manual_seed(rank)
    pages = -(-(prompt + steps * (reps + 2) + 2) // 64)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    ids = torch.randint(2, args.vocab_size, (batch * prompt,), generator=g).to(device)
    prefill = StepBatch(ids, [prompt] * batch, [prompt] * batch, table)

    def decode_batch(context: int) -> StepBatch:
        token = torch.full((batch,), 7, device=device)
        return StepBatch(token, [1] * batch, [context] * batch, table)

    with torch.no_grad():
        cache = M.PagedKVCache(args, batch * pages, 64, torch.bfloat16, device)
        got = [model.forward_step(prefill, cache)]
        got.append(model.forward_step(decode_batch(prompt + 1), cache))
        result = {"rank": rank}
        if rank == 0:
            one = M.from_args(args, seed=0, dtype=dtype, device=device)
            one_cache = M.PagedKVCache(args, batch * pages, 64, torch.bfloat16, device)
            want = [one.forward_step(prefill, one_cache)]
            want.append(one.forward_step(decode_batch(prompt + 1), one_cache))
            del one, one_cache
            worst = max(
                float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True)
            )
            agree = sum(
                int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(got, want, strict=True)
            )
            result |= {"max_logit_diff": worst, "greedy_agreement": agree / (2 * batch)}
        context = [prompt + 1]

        def decode():
            context[0] += 1
            model.forward_step(decode_batch(context[0]), cache)

        result["prefill_s"] = timed(lambda: model.forward_step(prefill, cache), reps)
        result["decode_s"] = timed(decode, steps)
    return result


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--preset", default="v2-lite" if cuda else "tiny")
    parser.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per rank")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gpu-per-rank", action="store_true", help="rank r on GPU r")
    parser.add_argument("--json")
    options = parser.parse_args()
    if options.gpu_per_rank and torch.cuda.device_count() < options.world:
        parser.error(f"--gpu-per-rank needs {options.world} GPUs")
    args = preset_args(options.preset, options.layers)
    where = torch.cuda.get_device_name() if cuda else "CPU"
    placement = "one GPU per rank" if options.gpu_per_rank else "all ranks on one device"
    print(
        f"expert-parallel {options.preset} ({args.num_hidden_layers} layers): {options.world} "
        f"ranks, {placement} ({where}); {options.batch} sequences per rank, prompt "
        f"{options.prompt}"
    )
    ranks = run_ranks(
        options.world,
        __file__,
        "rank_main",
        options.preset,
        options.layers,
        options.batch,
        options.prompt,
        options.steps,
        options.reps,
        timeout=600,
        limit=1800,
        gpu_per_rank=options.gpu_per_rank,
    )
    check = ranks[0]
    print(
        f"  against one process (rank 0's sequences): largest logit difference "
        f"{check['max_logit_diff']:.4f} of the largest logit, greedy tokens agree at "
        f"{100 * check['greedy_agreement']:.1f} % of positions"
    )
    sequences = options.world * options.batch
    prefill = sequences * options.prompt / max(r["prefill_s"] for r in ranks)
    decode = sequences / max(r["decode_s"] for r in ranks)
    gpus = options.world if options.gpu_per_rank else 1
    print(
        f"  instance: prefill {prefill:.0f} tok/s, decode {decode:.1f} tok/s "
        f"({prefill / gpus:.0f} and {decode / gpus:.1f} per device)"
    )
    if options.json:
        summary = dict(prefill_tok_s=prefill, decode_tok_s=decode, gpus=gpus)
        document = dict(vars(options), device=where, summary=summary, ranks=ranks)
        with open(options.json, "w") as f:
            json.dump(document, f, indent=1)
    if check["max_logit_diff"] > TOLERANCE:
        raise SystemExit(f"the instance's logits differ from one process by more than {TOLERANCE}")


if __name__ == "__main__":
    main()
