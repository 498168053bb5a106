"""KV transfer throughput per method at DeepSeek-V3's page size, next to copy ceilings.

    python benchmarks/bench_kv_transfer.py [--device cuda|cpu] [--prefill-device cuda:1]
                                           [--methods grpc,cuda_ipc,nixl]
                                           [--tokens 1024,4096,16384] [--reps 5] [--json PATH]

A V3 page is 64 tokens x 61 layers x 1,152 B (576 bf16 values: the 512 latent, the 64 rope
key) = 4,497,408 B. The model is the tiny preset (cache_width 576) with 61 layers: V3's pages
at a cheap prefill. The prefill instance is a real server process: this file run with
`--serve-prefill CONFIG` builds that model and its Engine and serves them through
`servers.run_instance` (PrefillService behind the secret gate), as `servers.serve` does for a
preset; `--model` would need a checkpoint directory, and nothing in src writes one. This
process is the decode side: an Engine of the same model whose cache a `KvPuller` fills.

For each method and prompt length, 1 + `--reps` prompts of random tokens are prefilled first
(untimed; a pull ends its request's lease, so each pull needs its own), then each is pulled
into blocks 0..pages-1. Timed: `await puller.pull(...)` with the device synchronized: the
data move and its RPCs (grpc: the Pull stream, Release; cuda_ipc, nixl: Locate, Release); the
figure is the median of the pulls after the untimed first. One puller per method, as a decode
instance keeps one, so ShareCache (mapping the cache, meeting the NIXL agent) falls in the
method's first pull. The first pull of each pair is checked: its pages here must equal the
bytes of the instance's own Pull stream for that handle. A method that cannot run (cuda_ipc
on the CPU, nixl not installed) is skipped with the reason; one that KvPuller serves another
way (a fallback) or that fails, fails loudly (exit status 1).

GB/s counts bytes delivered (pages x page bytes). Ceilings, in the same run, on this
process's device: the same pages copied within one cache (in every layer, a copy_ of blocks
0..pages-1 onto the blocks after them) and a 1 GiB copy_ (memory traffic: twice its figure).
On CUDA both caches share one GPU unless `--prefill-device` names another. The CPU default
is `--tokens 1024,4096`: a 61-layer prefill of 4,096 tokens takes ~25 s on 2 cores.

FP8 pages (mla-kernels' row: 512 e4m3 values, 4 fp32 scales, 64 bf16 rope values = 656 B)
never pass through the deployment, whose cache is bf16. With nixl, `NixlCache.read` of uint8
pages of that size from a second process (`--fp8-source`) is measured: NIXL's data move
alone, without the RPCs of the rows above.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import torch
from bench_model import median_seconds, sync  # this folder's: the same timing

import ref_server.model as M
from ref_server.engine import Engine, SchedulerConfig
from ref_server.services import kv_transfer, servers
from ref_server.services.config import ServeConfig
from ref_server.services.deployment import free_port, wait_serving
from ref_server.services.kv_transfer import TRANSFER_TIMEOUT, KvPuller, TransferError
from ref_server.services.security import SECRET_ENV, internal_channel, new_secret
from ref_server.v1 import serving_pb2 as pb
from ref_server.v1 import serving_pb2_grpc as rpc

V3_PAGES = dataclasses.replace(M.PRESETS["tiny"], num_hidden_layers=61)
PAGE_TOKENS = 64
PAGE_BYTES = V3_PAGES.num_hidden_layers * PAGE_TOKENS * V3_PAGES.cache_width * 2
FP8_ROW_BYTES = 656
FP8_PAGE_BYTES = V3_PAGES.num_hidden_layers * PAGE_TOKENS * FP8_ROW_BYTES
METHODS = {"grpc": kv_transfer.GRPC, "cuda_ipc": kv_transfer.CUDA_IPC, "nixl": kv_transfer.NIXL}
STARTUP_TIMEOUT, PREFILL_TIMEOUT = 300.0, 600.0


class MethodFailed(RuntimeError):
    """A pull that came another way than asked, or brought pages other than the instance's."""


def pages_of(tokens: int) -> int:
    return -(-tokens // PAGE_TOKENS)


def rates(tokens: int, seconds: float, page_bytes: int = PAGE_BYTES) -> dict:
    pages = pages_of(tokens)
    return dict(tokens=tokens, pages=pages, bytes=pages * page_bytes, seconds=seconds,
                gb_s=pages * page_bytes / seconds / 1e9, pages_s=pages / seconds)  # fmt: skip


def why_not(name: str, device: torch.device) -> str | None:
    if name == "cuda_ipc" and device.type != "cuda":
        return "CUDA IPC needs both caches on CUDA devices (--device cuda)"
    if name == "nixl" and importlib.util.find_spec("nixl") is None:
        return "nixl is not installed (pip install 'ref-server[nixl]')"
    return None


@contextlib.contextmanager
def helper(command: list[str], **popen):
    """A child process running this file, ended (SIGTERM, then SIGKILL) on the way out."""
    process = subprocess.Popen([sys.executable, os.path.abspath(__file__), *command], **popen)
    try:
        yield process
    finally:
        if process.stdin:
            process.stdin.close()
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def serve_prefill(config: ServeConfig) -> None:
    """The prefill instance's process: `servers.serve`, with V3_PAGES instead of a preset."""
    device = servers.torch_device(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = M.from_args(V3_PAGES, seed=config.seed, dtype=dtype, device=device)
    engine = Engine(model, servers.scheduler_config(config), prefill_graph_tokens=0)
    asyncio.run(servers.run_instance(config, servers.internal_secret(config), engine, None))


def check_pages(runner, targets: list[tuple[int, int]], sent: list[bytes]) -> None:
    for (index, block), data in zip(targets, sent, strict=True):
        if runner.read_page(block).numpy().tobytes() != data:
            raise MethodFailed(f"page {index} (block {block}) is not the prefill instance's")


async def pulled_seconds(puller: KvPuller, address, channel, tokens, reps, g) -> list[float]:
    """The seconds of each timed pull of `reps` prompts of `tokens` tokens, by the puller's
    method (after one untimed pull, checked)."""
    prefill, kv = rpc.PrefillStub(channel), rpc.KvTransferStub(channel)
    name, runner = puller.method, puller.runner
    unpulled, times = [], []
    try:
        for i in range(1 + reps):
            prompt = torch.randint(2, V3_PAGES.vocab_size, (tokens,), generator=g).tolist()
            request = pb.PrefillRequest(request_id=f"{name}-{tokens}-{i}", token_ids=prompt,
                                        sampling=pb.SamplingParams(max_tokens=1))  # fmt: skip
            unpulled.append(await prefill.Prefill(request, timeout=PREFILL_TIMEOUT))
        while unpulled:
            handle, num_pages = unpulled[0].kv_handle, unpulled[0].num_pages
            targets = list(enumerate(range(num_pages)))
            if first := not times:
                pull = kv.Pull(pb.PullRequest(kv_handle=handle), timeout=TRANSFER_TIMEOUT)
                sent = [message.data async for message in pull]
                for layer in runner.cache.layers:
                    layer.zero_()
            unpulled.pop(0)  # the pull releases it, whatever happens
            sync(runner.device)
            start = time.perf_counter()
            moved = await puller.pull(address, handle, targets, num_pages)
            sync(runner.device)
            times.append(time.perf_counter() - start)
            if moved != METHODS[name]:
                why = f" ({puller.why_not_nixl})" if puller.why_not_nixl else ""
                how = kv_transfer.NAMES[moved]
                raise MethodFailed(f"asked for {name}, KvPuller moved the pages by {how}{why}")
            if first:
                check_pages(runner, targets, sent)
    finally:
        for prefilled in unpulled:  # a failed method leaves no pages held for the next
            with contextlib.suppress(grpc.aio.AioRpcError):
                await kv.Release(pb.ReleaseRequest(kv_handle=prefilled.kv_handle), timeout=10)
    return times[1:]


async def measure(methods, tokens_list, reps, engine, address, secret, ceilings):
    """A row per method and prompt length; and why each failed method failed. A method's
    puller is kept over its lengths, as a decode instance keeps its own."""
    g = torch.Generator().manual_seed(0)
    limit = {"grpc.max_receive_message_length": kv_transfer.MAX_MESSAGE_BYTES}  # pages > 4 MB
    channel = internal_channel(address, secret, **limit)
    rows, failed = [], {}
    for name in methods:
        puller = KvPuller(engine.runner, secret, name)
        puller.set_peers([address])
        for tokens in tokens_list:
            try:
                times = await pulled_seconds(puller, address, channel, tokens, reps, g)
            except (TransferError, MethodFailed) as error:
                failed[name] = str(error)
                print(f"{name:8} | FAILED: {error}", flush=True)
                break
            row = dict(method=name, **rates(tokens, statistics.median(times)), times=times)
            row["of_page_copy"] = row["gb_s"] * 1e9 / ceilings["page_copy"][tokens]
            row["of_copy"] = row["gb_s"] * 1e9 / ceilings["copy"]
            rows.append(row)
            print(f"{name:8} | {tokens:6d} | {row['pages']:5d} | {row['seconds']:10.4f} | "
                  f"{row['gb_s']:7.2f} | {row['pages_s']:7.0f} | {row['of_page_copy']:10.2f} | "
                  f"{row['of_copy']:5.2f}", flush=True)  # fmt: skip
        await puller.peers[address].close()
    await channel.close()
    return rows, failed


def fp8_cache(num_blocks: int, device: torch.device, seed: int) -> SimpleNamespace:
    """FP8 pages of random bytes drawn from `seed`, as NixlCache reads a cache (layers, device,
    num_blocks); not a PagedKVCache, whose rows are 576 values of its dtype."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, PAGE_TOKENS, 1, FP8_ROW_BYTES)
    layers = [
        torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(device)
        for _ in range(V3_PAGES.num_hidden_layers)
    ]
    return SimpleNamespace(layers=layers, device=torch.device(device), num_blocks=num_blocks)


def serve_fp8_pages(num_blocks: int, device: str, offer: Path) -> None:
    """The FP8 pages' process: writes their NIXL descriptors to `offer`, then serves NIXL
    reads until its stdin closes."""
    from ref_server.services.nixl_transfer import NixlCache

    source = NixlCache(fp8_cache(num_blocks, torch.device(device), seed=1))
    pages = source.pages(list(range(num_blocks)))
    text = json.dumps(
        dict(metadata=source.metadata().hex(), kind=pages.kind, rows=pages.rows.hex())
    )
    offer.with_suffix(".part").write_text(text)
    offer.with_suffix(".part").replace(offer)  # whole, once it exists
    sys.stdin.read()
    source.close()


def measure_fp8(tokens_list: list[int], device: torch.device, reps: int) -> list[dict] | str:
    """NixlCache.read of each length's FP8 pages from a process of their own, or why not."""
    if reason := why_not("nixl", device):
        return f"not measured: {reason}"
    from ref_server.services.nixl_transfer import NixlCache, NixlUnavailable, Pages

    most, found = pages_of(max(tokens_list)), []
    try:
        reader = NixlCache(fp8_cache(most, device, seed=2))
    except NixlUnavailable as error:
        return f"not measured: {error}"
    held = fp8_cache(most, device, seed=1).layers  # the source's bytes, drawn alike
    with tempfile.TemporaryDirectory() as folder:
        offer = Path(folder, "offer.json")
        with helper(["--fp8-source", f"{most},{device},{offer}"], stdin=subprocess.PIPE) as source:
            deadline = time.monotonic() + STARTUP_TIMEOUT
            while not offer.exists():
                if source.poll() is not None or time.monotonic() > deadline:
                    raise MethodFailed(
                        f"the FP8 pages' process offered none (exit {source.poll()})"
                    )
                time.sleep(0.05)
            offered = json.loads(offer.read_text())
            peer = reader.connect(bytes.fromhex(offered["metadata"]))
            rows = np.frombuffer(bytes.fromhex(offered["rows"]), dtype="<i8").reshape(-1, most, 3)
            for tokens in tokens_list:
                pages = pages_of(tokens)
                wanted = Pages(offered["kind"], np.ascontiguousarray(rows[:, :pages]).tobytes())
                read = functools.partial(
                    reader.read, peer, wanted, list(range(pages)), TRANSFER_TIMEOUT
                )
                read()
                pairs = zip(reader.cache.layers, held, strict=True)
                if not all(torch.equal(a[:pages], b[:pages]) for a, b in pairs):
                    raise MethodFailed(f"the NIXL read of {pages} FP8 pages brought other bytes")
                found.append(rates(tokens, median_seconds(read, device, reps), FP8_PAGE_BYTES))
            reader.close()
    return found


def copy_pages(cache, pages: int) -> None:
    for layer in cache.layers:
        layer[pages : 2 * pages].copy_(layer[:pages])


def copy_ceilings(engine: Engine, tokens_list: list[int], reps: int) -> dict:
    """Bytes/s of a 1 GiB copy_, and of each length's pages copied within the cache (blocks
    0..pages-1 to the blocks after them, every layer)."""
    cache = engine.runner.cache
    buffer = torch.empty(1 << 30, dtype=torch.uint8, device=cache.device)
    copied = torch.empty_like(buffer)
    seconds = median_seconds(lambda: copied.copy_(buffer), cache.device, reps)
    page_copy = {}
    for tokens in tokens_list:
        copy = functools.partial(copy_pages, cache, pages_of(tokens))
        page_copy[tokens] = pages_of(tokens) * PAGE_BYTES / median_seconds(copy, cache.device, reps)
    return dict(copy=(1 << 30) / seconds, page_copy=page_copy)


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu", help="the decode side's")
    parser.add_argument("--prefill-device", help="the prefill instance's (default: --device)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tokens", help="prompt lengths (default 1024,4096,16384; CPU 1024,4096)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--serve-prefill", help=argparse.SUPPRESS)  # the prefill process
    parser.add_argument("--fp8-source", help=argparse.SUPPRESS)  # the FP8 pages' process
    options = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if options.serve_prefill:
        return serve_prefill(ServeConfig(**json.loads(options.serve_prefill)))
    if options.fp8_source:
        blocks, device, offer = options.fp8_source.split(",")
        return serve_fp8_pages(int(blocks), device, Path(offer))
    device = torch.device(options.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    default_tokens = "1024,4096,16384" if device.type == "cuda" else "1024,4096"
    tokens_list = [int(t) for t in (options.tokens or default_tokens).split(",")]
    methods = options.methods.split(",")
    if unknown := set(methods) - set(METHODS):
        parser.error(f"unknown methods {sorted(unknown)}; methods: {', '.join(METHODS)}")
    most = pages_of(max(tokens_list))

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = M.from_args(V3_PAGES, dtype=dtype, device=device)
    blocks = SchedulerConfig(num_blocks=2 * most, max_num_seqs=1, max_model_len=most * PAGE_TOKENS)
    engine = Engine(model, blocks, prefill_graph_tokens=0)
    ceilings = copy_ceilings(engine, tokens_list, options.reps)
    where = f"CPU ({os.cpu_count()} cores, {platform.machine()})"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else where
    nixl = importlib.metadata.version("nixl") if importlib.util.find_spec("nixl") else "absent"
    prefill_device = options.prefill_device or options.device
    page_copy = ", ".join(f"{t} tokens {b / 1e9:.2f}" for t, b in ceilings["page_copy"].items())
    print(f"KV pulls into {where} from a prefill instance on {prefill_device}; torch "
          f"{torch.__version__}, nixl {nixl}\nV3 page: 61 layers x 64 tokens x 1,152 B = "
          f"{PAGE_BYTES:,} B; GB/s: bytes delivered a second\nceilings: copy_ of 1 GiB "
          f"{ceilings['copy'] / 1e9:.2f} GB/s (memory traffic twice); the pages copied within "
          f"one cache: {page_copy} GB/s")  # fmt: skip
    skipped = {name: why for name in methods if (why := why_not(name, device))}
    for name, why in skipped.items():
        print(f"{name:8} | skipped: {why}")
    print("method   | tokens | pages | s (median) |    GB/s | pages/s | /page copy | /copy")

    config = ServeConfig(
        role="prefill", port=free_port(), device=prefill_device, max_num_seqs=1,
        num_blocks=(1 + options.reps) * (most + 1), max_model_len=(most + 1) * PAGE_TOKENS,
        hold_seconds=2 * PREFILL_TIMEOUT, prefill_graph_tokens=0,
    )  # fmt: skip
    address, secret = f"127.0.0.1:{config.port}", new_secret()
    # the supervisor: the instance stops by itself should this process die
    env = {**os.environ, SECRET_ENV: secret, servers.SUPERVISOR_ENV: str(os.getpid())}
    command = ["--serve-prefill", json.dumps(dataclasses.asdict(config))]
    with helper(command, env=env, stdout=subprocess.DEVNULL) as prefill:
        wait_serving(address, STARTUP_TIMEOUT, prefill)
        running = [name for name in methods if name not in skipped]
        rows, failed = asyncio.run(
            measure(running, tokens_list, options.reps, engine, address, secret, ceilings)
        )
    fp8 = "not measured: nixl is not among --methods"
    try:
        fp8 = measure_fp8(tokens_list, device, options.reps) if "nixl" in methods else fp8
    except (TransferError, MethodFailed) as error:
        failed["fp8 nixl"] = str(error)
        fp8 = f"FAILED: {error}"
    figures = fp8
    if isinstance(fp8, list):
        figures = ", ".join(
            f"{r['tokens']} tokens {r['seconds']:.4f} s {r['gb_s']:.2f} GB/s" for r in fp8
        )
    print(f"FP8 page: 61 x 64 x {FP8_ROW_BYTES} B = {FP8_PAGE_BYTES:,} B, never moved by the "
          f"deployment (its cache is bf16); NixlCache.read alone, from another process: "
          f"{figures}")  # fmt: skip
    if options.json:
        document = dict(
            methods=methods, tokens=tokens_list, reps=options.reps, device=where,
            prefill_device=prefill_device, torch=torch.__version__, nixl=nixl,
            page_bytes=PAGE_BYTES, fp8_page_bytes=FP8_PAGE_BYTES, ceilings=ceilings, rows=rows,
            skipped=skipped, failed=failed, fp8=fp8,
        )  # fmt: skip
        Path(options.json).write_text(json.dumps(document, indent=1))
    if failed:
        sys.exit("FAILED: " + "; ".join(f"{name}: {why}" for name, why in failed.items()))


if __name__ == "__main__":
    main()
