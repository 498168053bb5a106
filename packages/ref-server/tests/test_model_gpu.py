"""The model on the GPU (`gpu` marker): the V2-Lite-sized preset against the same weights in
float32 on the CPU, and expert parallelism over processes sharing the GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import ref_server.model as M
from ep_comm.testing import run_ranks
from ref_server.engine import Engine, SchedulerConfig
from ref_server.model import SamplingParams, StepBatch
from ref_server.model.moe import MoE
from ref_server.model.sampling import sample

pytestmark = pytest.mark.gpu


def routing_recorder(model) -> list:
    """Every MoE gate's choice (weights, ids), in call order."""
    calls = []
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            gate, select = layer.mlp.gate, layer.mlp.gate.select

            def recording(scores, real_rows=None, select=select):
                out = select(scores, real_rows)
                calls.append(tuple(t.cpu() for t in out))
                return out

            gate.select = recording
    return calls


def replay_routing(model, calls: list) -> None:
    """Make model's gates choose the recorded experts, in the same call order."""
    recorded = iter(calls)
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.gate.select = lambda scores, real_rows=None: next(recorded)


def test_v2_lite_layers_on_the_gpu_match_cpu_float32_math():
    """Three layers of the V2-Lite-sized preset (one dense, two MoE: 64 experts, top-6), random
    weights, bf16 on the GPU: the full pass, a paged prefill over scattered pages and absorbed
    decode steps through mla_kernels' CUDA kernel match the float32 CPU model holding the same
    weights. The CPU model takes the GPU's expert choices: among 64 close sigmoid scores, bf16
    rounding alone flips some of them (the gate itself is checked against transformers)."""
    args = small_v2_lite()
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


def small_v2_lite():
    return dataclasses.replace(M.PRESETS["v2-lite"], num_hidden_layers=3, vocab_size=4096)


def small_v32_lite():
    """V3.2's GPU preset cut down as `small_v2_lite`, its indexer picking 128 of up to 256."""
    return dataclasses.replace(
        M.PRESETS["v3.2-lite"], num_hidden_layers=3, vocab_size=4096, index_topk=128
    )


@pytest.mark.parametrize("args", [small_v2_lite(), small_v32_lite()], ids=["v2-lite", "v3.2-lite"])
def test_decode_graphs_match_the_eager_step(args):
    """Decode batches through the captured graphs against eager steps on a copy of the cache.
    At a bucket's size the two run the same kernels on the same shapes: bit-identical logits
    and cache rows. Between buckets (3 and 5 sequences, padded to 4 and 8) the padded GEMMs may
    round differently (V3.2's: enough to swap the indexer's near-ties, so not compared there).
    The padding block starts as NaN and no NaN leaks out. V3.2's decode captures whole: the
    indexer's selection over the block table (its width fixed by the graph) and sparse MLA."""
    model = M.from_args(args, seed=1, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(1)
    eager, captured = (M.PagedKVCache(args, 64, 64, device="cuda") for _ in range(2))
    for mine, other in zip(eager.page_tensors, captured.page_tensors, strict=True):
        mine.copy_(torch.randn(mine.shape, generator=g).to(mine.dtype))
        other.copy_(mine)
        other[captured.padding_block] = float("nan")
    graphs = M.DecodeGraphs(model, captured, max_batch=16, max_blocks=4)
    assert graphs.buckets == [1, 2, 4, 8, 16]
    for b in (4, 1, 16, 3, 5):
        tables = torch.randperm(64, generator=g)[: b * 4].view(b, 4).int()
        context = torch.randint(1, 4 * 64, (b,), generator=g).tolist()
        ids = torch.randint(2, args.vocab_size, (b,), generator=g)
        batch = StepBatch(ids.cuda(), [1] * b, context, tables)
        want = model.forward_step(batch, eager)
        got = graphs(batch).clone()
        if b in graphs.buckets:
            assert torch.equal(got, want)
        elif not args.is_sparse:
            assert ((got - want).abs().amax(dim=-1) < 0.02 * want.abs().max()).all()
        assert not got.isnan().any()
    for mine, other in zip(eager.page_tensors, captured.page_tensors, strict=True):
        torch.testing.assert_close(other[:-1].float(), mine[:-1].float(), rtol=0.02, atol=0.02)
    with pytest.raises(ValueError, match="exceeds the captured 16 sequences and 4 blocks"):
        graphs(StepBatch(ids[:1].cuda(), [1], [1], torch.zeros(1, 5, dtype=torch.int32)))
    with pytest.raises(ValueError, match="decode steps only"):
        graphs(StepBatch(ids[:2].cuda(), [2], [2], torch.zeros(1, 1, dtype=torch.int32)))


def test_engine_on_the_gpu_matches_one_process_generation():
    """The engine (paged cache, decode through the graphs) against `generate` (eager, pages in
    order): four prompts decode together at batch 4, a bucket's size, so greedy tokens agree."""
    model = M.from_args(small_v2_lite(), seed=2, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 4096, (n,), generator=g).tolist() for n in (70, 9, 130, 33)]
    params = SamplingParams(max_tokens=20)
    config = SchedulerConfig(num_blocks=32, block_size=64, max_num_seqs=8, max_model_len=512)
    engine = Engine(model, config)
    assert engine.runner.decode_graphs is not None
    assert engine.generate(prompts, params) == model.generate(prompts, params)


def test_overlapped_engine_steps_on_the_gpu_give_the_same_tokens():
    """`overlap_steps="on"` against steps in turn on CUDA: prefill and decode from graphs, each
    decode step's input tokens gathered on the device from the step before, greedy and seeded
    requests arriving while others decode. Without an eos token and with room for every
    request, both run the same batches, so the tokens are equal, not only near."""
    args = dataclasses.replace(small_v2_lite(), eos_token_id=None)
    model = M.from_args(args, seed=4, dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(4)
    lengths = (70, 9, 130, 33, 1, 300)
    prompts = [torch.randint(2, 4096, (n,), generator=g).tolist() for n in lengths]
    params = [
        SamplingParams(max_tokens=20 + i, temperature=0.8 * (i % 2), top_p=0.9, seed=i)
        for i in range(len(prompts))
    ]
    config = SchedulerConfig(num_blocks=64, block_size=64, max_num_seqs=16, max_model_len=512)
    completions = {}
    for mode in ("off", "on"):
        engine = Engine(model, config, overlap_steps=mode, prefill_graph_tokens=512)
        assert engine.runner.decode_graphs and engine.runner.prefill_graphs
        seqs, calls = [], 0
        while len(seqs) < len(prompts) or engine.has_work():
            if calls % 3 == 0 and len(seqs) < len(prompts):  # one request every third step
                seqs.append(engine.add(prompts[len(seqs)], params[len(seqs)]))
            engine.step()
            calls += 1
        completions[mode] = [seq.completion for seq in seqs]
        assert engine.scheduler.blocks.num_free == config.num_blocks
    assert completions["on"] == completions["off"]
    assert [len(c) for c in completions["on"]] == [p.max_tokens for p in params]


def test_sampling_on_the_gpu_draws_what_the_cpu_draws():
    """The Gumbel noise is integer hashing: the same draws on either device."""
    logits = torch.randn(64, 102_400, generator=torch.Generator().manual_seed(9))
    params = [
        SamplingParams(
            temperature=0.5 + i / 64, top_p=(1.0, 0.9)[i % 2], top_k=50 * (i % 3), seed=i
        )
        for i in range(64)
    ]
    positions = list(range(100, 164))
    assert sample(logits.cuda(), params, positions) == sample(logits, params, positions)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_ranks_sharing_the_gpu_match_one_rank(world, checkpoints, tmp_path):
    checkpoints.write(tmp_path, seed=9)
    scenarios = str(Path(__file__).with_name("model_scenarios.py"))
    run_ranks(
        world, scenarios, "expert_parallel_matches_one_process", str(tmp_path), "cuda", limit=600
    )
