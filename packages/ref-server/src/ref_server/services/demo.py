"""`ref-server demo`: the deployment on loopback, a few concurrent requests, what it measured."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from rich.console import Console

from ref_server.client import Client
from ref_server.services.config import ServeConfig
from ref_server.services.deployment import Deployment

PROMPTS = [
    "DeepSeek serves its models from separate prefill and decode clusters.",
    "Multi-head latent attention keeps one compressed latent per token.",
    "Experts are spread over many GPUs; tokens travel to them and back.",
    "Two microbatches overlap communication with computation.",
]


def visible(text: str) -> str:
    """Text for a terminal: control characters (random weights produce them) as escapes."""
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


def run_demo(config: ServeConfig, num_requests: int, max_tokens: int, console: Console) -> dict:
    """Send the requests, stream the first to the console; returns what was measured."""
    weights = (
        f"checkpoint {config.model}" if config.model else f"preset {config.preset}, random weights"
    )
    console.print(
        f"[bold]starting[/] a prefill and a decode instance ({weights}, device {config.device}) "
        f"and the router on port {config.port} (HTTP {config.http_port})"
    )
    if not config.model:
        console.print("random weights: the generated text is noise; the timings are real")
    deployment = Deployment(config)
    try:
        with Client(deployment.address) as client:

            def send(i: int):
                shown = (
                    (lambda c: console.print(visible(c.text), end="", markup=False))
                    if i == 0
                    else None
                )
                prompt = PROMPTS[i % len(PROMPTS)]
                try:
                    return client.generate(
                        prompt, max_tokens=max_tokens, temperature=0.7, seed=i, on_chunk=shown
                    )
                except grpc.RpcError as error:
                    return f"{error.code().name}: {error.details()}"

            console.print(f"[bold]request 0[/]: {PROMPTS[0]!r} ->")
            with ThreadPoolExecutor(max_workers=num_requests) as pool:
                start = time.monotonic()
                results = list(pool.map(send, range(num_requests)))
                elapsed = time.monotonic() - start
            console.print()
    finally:
        deployment.stop()
    failed = [r for r in results if isinstance(r, str)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {num_requests} demo requests failed: {failed[0]}")
    prompt_tokens = sum(r.usage.prompt_tokens for r in results)
    output_tokens = sum(r.usage.completion_tokens for r in results)
    ttft = sorted(r.first_token_s for r in results)[len(results) // 2]
    console.print(
        f"[bold]{num_requests} requests[/] in {elapsed:.2f} s: {prompt_tokens} prompt tokens, "
        f"{output_tokens} generated ({output_tokens / elapsed:.1f} tokens/s), median time to "
        f"first token {ttft * 1000:.0f} ms"
    )
    console.print(
        "No cost figures: this is one small deployment on this machine, not a DeepSeek node; "
        "`ref-server economics` reproduces DeepSeek's published day."
    )
    return {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "seconds": elapsed}
