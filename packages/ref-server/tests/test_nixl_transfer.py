"""KV pages through NIXL (UCX) between two processes on the CPU (`NixlCache`). Both sides run
in processes of their own (`nixl_peer.py`): nixl cannot share this one with grpc_tools' protoc,
which another test module loads."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

import ref_server.model as M
from ref_server.client import Client
from ref_server.services.deployment import Deployment, free_port, serve_command, wait_serving
from ref_server.services.kv_transfer import HOST_ID_ENV
from ref_server.services.nixl_transfer import NixlCache, NixlUnavailable, Pages, cache_pages
from ref_server.services.security import SECRET_ENV, new_secret

PEER = Path(__file__).with_name("nixl_peer.py")
LAYERS = M.PRESETS["tiny"].num_hidden_layers
PAGE_BYTES = 16 * M.PRESETS["tiny"].cache_width * 2
needs_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None, reason="nixl is not installed"
)


def wait_for(path: Path, process: subprocess.Popen, what: str):
    deadline = time.monotonic() + 90
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {what} process ended or hung (exit {process.poll()})")
        time.sleep(0.05)
    return torch.load(path)


@pytest.fixture
def prefill(tmp_path):
    """A prefill process holding blocks 3, 1, 5 for us: (its saved file, values, process)."""
    out = tmp_path / "prefill.pt"
    process = subprocess.Popen(
        [sys.executable, str(PEER), "prefill", str(out), "3,1,5"], stdin=subprocess.PIPE
    )
    try:
        _, _, _, values = wait_for(out, process, "prefill")
        yield out, values, process
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def decode(tmp_path, given: Path, case: str = "read") -> dict:
    out = tmp_path / f"decode-{case}.pt"
    process = subprocess.Popen(
        [sys.executable, str(PEER), "decode", str(given), str(out), "0,2,4", case]
    )
    try:
        return wait_for(out, process, "decode")
    finally:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


@needs_nixl
def test_a_decode_process_reads_the_leased_pages_into_its_reserved_blocks(tmp_path, prefill):
    given, values, _ = prefill
    result = decode(tmp_path, given)
    assert "error" not in result, result.get("error")
    assert result["same_peer_again"] and result["peers"] == 1  # metadata added once per pair
    assert result["moved"] == 3 * LAYERS * PAGE_BYTES
    for mine, theirs in zip(result["layers"], values, strict=True):
        assert torch.equal(mine[[0, 2, 4]], theirs)
        assert not mine[[1, 3, 5, 6, 7, 8]].any()  # nothing else was written


@needs_nixl
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("short", f"the peer offers 9 pages, 2 blocks x {LAYERS} page tensors"),
        ("unknown-peer", "no NIXL connection to 'elsewhere'"),
    ],
)
def test_a_read_that_does_not_match_is_refused_and_writes_nothing(tmp_path, prefill, case, message):
    given, _, _ = prefill
    result = decode(tmp_path, given, case)
    assert message in result["error"]
    assert not any(layer.any() for layer in result["layers"])


@needs_nixl
def test_a_dead_peer_is_a_transfer_error(tmp_path, prefill):
    given, _, process = prefill
    process.kill()
    process.wait(timeout=30)
    result = decode(tmp_path, given)
    # UCX finds the peer gone when the agent connects, or else when the read starts or ends
    error = result["error"]
    assert "no NIXL connection to the peer" in error or "NIXL read of 9 pages from" in error
    assert not any(layer.any() for layer in result["layers"])


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        (Pages("HBM", b"\0" * 24), "memory kind must be one of"),
        (Pages("DRAM", b"\0" * 23), r"whole \(address, bytes, device\) triples"),
        (Pages("DRAM", np.array([[1, 0, 0]], dtype="<i8").tobytes()), "non-zero sizes"),
        (Pages("DRAM", np.array([[-1, 8, 0]], dtype="<i8").tobytes()), "non-negative"),
    ],
)
def test_bad_page_descriptors_are_refused_before_any_transfer(pages, message):
    with pytest.raises(ValueError, match=message):
        pages.descriptors()


def test_the_pages_of_a_cache_name_every_layer_of_each_block_in_order():
    kv = M.PagedKVCache(M.PRESETS["tiny"], 8, 16)
    pages = cache_pages(kv, [2, 0])
    rows = np.frombuffer(pages.rows, dtype="<i8").reshape(-1, 3)
    want = [(layer[b].data_ptr(), PAGE_BYTES, 0) for layer in kv.layers for b in (2, 0)]
    assert pages.kind == "DRAM" and [tuple(r) for r in rows.tolist()] == want


def test_a_v32_cache_s_pages_name_its_index_keys_and_scales_after_the_latent_rows():
    args = M.PRESETS["v3.2-tiny"]
    kv = M.PagedKVCache(args, 8, 16)
    rows = np.frombuffer(cache_pages(kv, [2, 0]).rows, dtype="<i8").reshape(-1, 3)
    tensors = kv.layers + [k.values for k in kv.index_keys] + [k.scales for k in kv.index_keys]
    sizes = [PAGE_BYTES] * LAYERS + [16 * 128] * LAYERS + [16 * 4] * LAYERS
    pairs = zip(tensors, sizes, strict=True)
    want = [(t[b].data_ptr(), size, 0) for t, size in pairs for b in (2, 0)]
    assert [tuple(r) for r in rows.tolist()] == want
    assert 16 * M.cache_bytes_per_token(args) == sum(sizes) == 16 * LAYERS * (1152 + 132)


def test_an_mtp_cache_s_pages_name_the_module_s_rows_and_the_prompt_s_hidden_state_last():
    args = dataclasses.replace(M.PRESETS["tiny"], num_nextn_predict_layers=1)
    kv = M.PagedKVCache(args, 8, 16)
    rows = np.frombuffer(cache_pages(kv, [2, 0]).rows, dtype="<i8").reshape(-1, 3)
    tensors = [*kv.layers, kv.prompt_hidden]
    sizes = [PAGE_BYTES] * (LAYERS + 1) + [args.hidden_size * 4]
    pairs = zip(tensors, sizes, strict=True)
    want = [(t[b].data_ptr(), size, 0) for t, size in pairs for b in (2, 0)]
    assert [tuple(r) for r in rows.tolist()] == want
    assert M.cache_page_bytes(args, 16) == sum(sizes) == kv.page_bytes


def test_without_nixl_the_agent_says_how_to_get_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_nixl(name, *args, **kwargs):
        if name.startswith("nixl"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_nixl)
    with pytest.raises(NixlUnavailable, match=r"nixl is not installed .*: pip install nixl"):
        NixlCache(M.PagedKVCache(M.PRESETS["tiny"], 8, 16))


# ---- a deployment whose KV moves through NIXL ----


def metric(text: str, name: str) -> float:
    """A sample's value in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def served_metrics(address: str, http_port: int, prompts: list[list[int]], preset="tiny") -> str:
    """Each prompt's 8 greedy tokens through the router at address, asserted equal to a
    one-process model's (the deployments' preset and seed); then the router's metrics text."""
    reference = M.from_preset(preset, seed=4)
    with Client(address) as client:
        for prompt in prompts:
            want = reference.generate([prompt], M.SamplingParams(max_tokens=8))[0]
            assert (
                client.generate(prompt, temperature=0, max_tokens=8, timeout=60).token_ids == want
            )
    url = f"http://127.0.0.1:{http_port}/metrics"
    return urllib.request.urlopen(url, timeout=5).read().decode()


@needs_nixl
@pytest.mark.parametrize("preset", ["tiny", "v3.2-tiny"])
def test_a_deployment_with_kv_transfer_nixl_serves_what_one_process_generates(
    serving, capfd, preset
):
    """`--kv-transfer nixl` on loopback (UCX, host memory): the tokens of a one-process model,
    every page by NIXL (the router's per-method bytes: V3.2's with the index keys), the agents
    met once (the decode instance logs the way its pages come when it changes)."""
    prompts = [list(range(2, 60)), [9] * 17, list(range(100, 230)), [5, 6, 7]]
    running = Deployment(serving.config(kv_transfer="nixl", preset=preset), startup_timeout=120)
    try:
        text = served_metrics(running.address, running.config.http_port, prompts, preset)
    finally:
        running.stop()
    pages = sum(-(-len(prompt) // 16) for prompt in prompts)
    page_bytes = 16 * M.cache_bytes_per_token(M.PRESETS[preset])
    assert metric(text, 'ref_server_kv_transfer_bytes_total{method="nixl"}') == pages * page_bytes
    assert metric(text, 'ref_server_kv_transfer_bytes_total{method="grpc"}') == 0
    captured = capfd.readouterr()
    logged = captured.out + captured.err
    assert logged.count("comes by a NIXL read (--kv-transfer nixl)") == 1, logged[-3000:]
    assert "without NIXL" not in logged and "has no NIXL agent" not in logged


@needs_nixl
def test_a_decode_instance_drafts_from_the_hidden_state_its_nixl_read_brings(serving, tmp_path):
    """`--kv-transfer nixl --speculative mtp`: the pages read through NIXL bring the prompt's
    last hidden state (`drafts_as_one_engine`), and the router counts it in their bytes."""
    reference = M.from_preset("tiny", seed=4)
    config = serving.config(kv_transfer="nixl", draft_tokens=3)
    running = serving.drafting_by_oracle(config, reference, tmp_path)
    try:
        serving.drafts_as_one_engine(running, reference)
        url = f"http://127.0.0.1:{running.config.http_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        running.stop()
    args = dataclasses.replace(reference.args, num_nextn_predict_layers=1)
    pages = sum(-(-len(prompt) // 16) for prompt in serving.drafted)
    moved = metric(text, 'ref_server_kv_transfer_bytes_total{method="nixl"}')
    assert moved == pages * M.cache_page_bytes(args, 16)
    assert metric(text, 'ref_server_kv_transfer_bytes_total{method="grpc"}') == 0


@needs_nixl
def test_agents_that_cannot_start_say_why_and_the_stream_serves(serving, capfd, monkeypatch):
    """`--kv-transfer nixl` where UCX has no transport (UCX_TLS names none), so that the decode
    instance's agent cannot start: the pages come by the gRPC stream, the log says why, and the
    prefill instance is not asked to start one."""
    monkeypatch.setenv("UCX_TLS", "no-such-transport")
    running = Deployment(serving.config(kv_transfer="nixl"), startup_timeout=120)
    try:
        text = served_metrics(running.address, running.config.http_port, [list(range(2, 60))])
    finally:
        running.stop()
    page_bytes = LAYERS * PAGE_BYTES
    assert metric(text, 'ref_server_kv_transfer_bytes_total{method="grpc"}') == 4 * page_bytes
    assert metric(text, 'ref_server_kv_transfer_bytes_total{method="nixl"}') == 0
    captured = capfd.readouterr()
    logged = captured.out + captured.err
    assert "comes by a gRPC stream (no NIXL agent here: a NIXL agent" in logged, logged[-3000:]
    assert "no NIXL KV transfer from this instance" not in logged, logged[-3000:]


@needs_nixl
def test_instances_on_two_simulated_hosts_move_kv_through_nixl_by_default(serving, capfd):
    """A prefill instance on 127.0.0.2 and a decode instance on 127.0.0.3 that count as two
    hosts (HOST_ID_ENV), launched one by one as on separate machines, with the router
    beside: `--kv-transfer auto` reads the pages through NIXL ("across hosts")."""
    config = serving.config()
    prefill, decode = f"127.0.0.2:{free_port()}", f"127.0.0.3:{free_port()}"
    router = f"127.0.0.1:{config.port}"
    env = os.environ | {SECRET_ENV: new_secret()}
    launches = [
        (prefill, dict(role="prefill", host="127.0.0.2", port=int(prefill.split(":")[1])), "a"),
        (decode, dict(role="decode", host="127.0.0.3", port=int(decode.split(":")[1])), "b"),
        (router, dict(role="router", prefill=[prefill], decode=[decode]), "a"),
    ]
    processes = []
    try:
        for address, launch, host in launches:
            command = serve_command(config, **launch)
            processes.append(subprocess.Popen(command, env=env | {HOST_ID_ENV: host}))
            wait_serving(address, 120, processes[-1])
        with Client(router) as client:
            serving.wait_until(
                lambda: len(client.server_info().workers) == 2, 30, "both instances registered"
            )
        text = served_metrics(router, config.http_port, [list(range(2, 60))])
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
    assert (
        metric(text, 'ref_server_kv_transfer_bytes_total{method="nixl"}') == 4 * LAYERS * PAGE_BYTES
    )
    captured = capfd.readouterr()
    assert "comes by a NIXL read (across hosts)" in captured.out + captured.err


@needs_nixl
def test_a_read_that_fails_midway_fails_its_request_and_frees_the_pages_on_both_sides(
    serving, monkeypatch
):
    """The decode instance's first NIXL read fails after half of the request's pages came
    (`faults/sitecustomize.py`): that request fails with the reason, the router counts the
    failure, both instances free every page, and the next request is served right."""
    faults = str(Path(__file__).with_name("faults"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([faults, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("REF_SERVER_TEST_FAIL_NIXL_READS", "1")
    prompt = list(range(2, 60))  # 4 pages: 2 read, then the link goes down
    running = Deployment(serving.config(kv_transfer="nixl"), startup_timeout=120)
    try:
        with Client(running.address) as client:
            with pytest.raises(grpc.RpcError) as failed:
                client.generate(prompt, temperature=0, max_tokens=8, timeout=60)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "injected: the link went down after 2 of 4 pages" in failed.value.details()
            serving.wait_idle(client)
        text = served_metrics(running.address, running.config.http_port, [prompt])
    finally:
        running.stop()
    assert metric(text, "ref_server_kv_transfer_failures_total") == 1
    page_bytes = LAYERS * PAGE_BYTES
    assert metric(text, 'ref_server_kv_transfer_bytes_total{method="nixl"}') == 4 * page_bytes


@needs_nixl
def test_an_instance_whose_two_ranks_are_on_two_simulated_hosts_starts_under_torchrun(serving):
    """A decode instance of two ranks, one on each of two simulated hosts (127.0.0.3 and
    127.0.0.4, `torchrun --nnodes 2 --node-rank R` on each, meeting at node 0's address),
    and a prefill instance on a third (127.0.0.2): the router serves the one-process tokens
    from both ranks, every page read across hosts through NIXL."""
    config = serving.config()
    ports = free_port(), free_port(), free_port()
    prefill = f"127.0.0.2:{ports[0]}"
    ranks = [f"127.0.0.3:{ports[1]}", f"127.0.0.4:{ports[1]}"]
    env = os.environ | {SECRET_ENV: new_secret()}
    decode = serve_command(config, role="decode", port=ports[1])[2:]
    processes = [
        subprocess.Popen(
            serve_command(config, role="prefill", host="127.0.0.2", port=ports[0]),
            env=env | {HOST_ID_ENV: "a"},
        )
    ]
    try:
        for node, host in enumerate(("127.0.0.3", "127.0.0.4")):
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
            torchrun += ["--node-rank", str(node), "--nproc-per-node", "1"]
            torchrun += ["--master-addr", "127.0.0.3", "--master-port", str(ports[2]), "-m"]
            processes.append(
                subprocess.Popen(
                    [*torchrun, *decode, "--host", host], env=env | {HOST_ID_ENV: f"b{node}"}
                )
            )
        for address in (prefill, *ranks):
            wait_serving(address, 120)
        router = serve_command(config, role="router", prefill=[prefill], decode=ranks)
        processes.append(subprocess.Popen(router, env=env))
        wait_serving(f"127.0.0.1:{config.port}", 60, processes[-1])
        prompts = [list(range(2, 60)), [9] * 17, list(range(100, 230)), [5, 6, 7]]
        with Client(f"127.0.0.1:{config.port}") as client:
            serving.wait_until(
                lambda: len(client.server_info().workers) == 3, 30, "all three registered"
            )
        text = served_metrics(f"127.0.0.1:{config.port}", config.http_port, prompts)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    pages = sum(-(-len(prompt) // 16) for prompt in prompts)
    nixl_bytes = metric(text, 'ref_server_kv_transfer_bytes_total{method="nixl"}')
    assert nixl_bytes == pages * LAYERS * PAGE_BYTES
    for rank in ("decode-0", "decode-1"):
        assert metric(text, f'ref_server_worker_healthy{{worker="{rank}"}}') == 1, text
