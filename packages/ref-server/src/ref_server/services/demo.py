"""`ref-server demo`: the deployment on loopback, a few concurrent requests, what it measured."""

from __future__ import annotations

import threading
import time

import grpc
from rich.console import Console

from ref_server.services.client import Client, request
from ref_server.services.deployment import Deployment, ServeConfig

PROMPTS = [
    "DeepSeek serves its models from separate prefill and decode clusters.",
    "Multi-head latent attention keeps one compressed latent per token.",
    "Experts are spread over many GPUs; tokens travel to them and back.",
    "Two microbatches overlap communication with computation.",
]


def run_demo(config: ServeConfig, num_requests: int, max_tokens: int, console: Console) -> dict:
    """Send the requests, stream the first to the console; returns measured throughput as
    economics overrides (one deployment counted as one node)."""
    model = config.model or f"preset {config.preset}"
    console.print(
        f"[bold]starting[/] a prefill and a decode instance ({model}, {config.torch_device}) "
        f"and the router on port {config.port}"
    )
    deployment = Deployment(config)
    try:
        client = Client(deployment.address)
        results = [None] * num_requests
        start = time.monotonic()

        def send(i: int) -> None:
            shown = (
                (lambda chunk: console.print(chunk.text, end="", markup=False)) if i == 0 else None
            )
            prompt = PROMPTS[i % len(PROMPTS)]
            message = request(text=prompt, max_tokens=max_tokens, temperature=0.7, seed=i)
            try:
                results[i] = client.generate(message, timeout=600, on_chunk=shown)
            except grpc.RpcError as error:
                results[i] = f"{error.code().name}: {error.details()}"

        console.print(f"[bold]request 0[/]: {PROMPTS[0]!r} ->")
        threads = [threading.Thread(target=send, args=(i,)) for i in range(num_requests)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - start
        console.print()
        client.close()
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
    return {
        "prefill_tokens_per_s_per_node": prompt_tokens / elapsed,
        "decode_tokens_per_s_per_node": output_tokens / elapsed,
    }
