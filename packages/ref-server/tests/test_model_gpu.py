"""The model on the GPU (`gpu` marker): the V2-Lite-sized preset against the same weights in
float32 on the CPU, and expert parallelism over processes sharing the GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import ref_server.model as M
from ep_comm.testing import run_ranks
from ref_server.model import StepBatch
from ref_server.model.transformer import MoE

pytestmark = pytest.mark.gpu


def routing_recorder(model) -> list:
    """Every MoE gate's (weights, ids), in call order."""
    calls = []
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.gate.register_forward_hook(
                lambda gate, inputs, out: calls.append(tuple(t.cpu() for t in out))
            )
    return calls


def replay_routing(model, calls: list) -> None:
    """Make model's gates return the recorded choices, in the same call order."""
    recorded = iter(calls)
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.gate.forward = lambda x: next(recorded)


def test_v2_lite_layers_on_the_gpu_match_cpu_float32_math():
    """Three layers of the V2-Lite-sized preset (one dense, two MoE: 64 experts, top-6), random
    weights, bf16 on the GPU: the full pass, a paged prefill over scattered pages and absorbed
    decode steps through mla_kernels' CUDA kernel match the float32 CPU model holding the same
    weights. The CPU model takes the GPU's expert choices: among 64 close sigmoid scores, bf16
    rounding alone flips some of them (the gate itself is checked against transformers)."""
    args = dataclasses.replace(M.PRESETS["v2-lite"], num_hidden_layers=3, vocab_size=4096)
    gpu = M.from_args(args, seed=0, dtype=torch.bfloat16, device="cuda")
    cpu = M.from_args(args, seed=0, dtype=torch.float32)
    cpu.load_state_dict({k: v.float().cpu() for k, v in gpu.state_dict().items()})
    ids = torch.randint(2, args.vocab_size, (2, 300), generator=torch.Generator().manual_seed(0))
    table = torch.tensor([[5, 1, 9, 3, 0], [7, 8, 10, 11, 12]], dtype=torch.int32)
    steps = [StepBatch(ids.flatten(), [300, 300], [300, 300], table)]
    for step in range(4):
        context = 301 + step
        steps.append(StepBatch(torch.tensor([11 + step, 17]), [1, 1], [context, context], table))

    def run(model, device):
        cache = M.PagedKVCache(args, 16, 64, device=device)
        outputs = [model(ids.to(device))[0]]
        for batch in steps:
            on_device = dataclasses.replace(batch, input_ids=batch.input_ids.to(device))
            outputs.append(model.forward_step(on_device, cache))
        return [o.float().cpu() for o in outputs]

    calls = routing_recorder(gpu)
    got = run(gpu, "cuda")
    replay_routing(cpu, calls)
    want = run(cpu, "cpu")
    for g, w in zip(got, want, strict=True):
        assert ((g - w).abs().amax(dim=-1) < 0.03 * w.abs().max()).all()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_ranks_sharing_the_gpu_match_one_rank(world, checkpoints, tmp_path):
    checkpoints.write(tmp_path, seed=9)
    scenarios = str(Path(__file__).with_name("model_scenarios.py"))
    run_ranks(
        world, scenarios, "expert_parallel_matches_one_process", str(tmp_path), "cuda", limit=600
    )
