"""PrefillGraphs' parts that need no GPU: its buckets, how it cuts a step, what it refuses."""

from __future__ import annotations

import pytest

import ref_server.model as M
from ref_server.model.prefill_graphs import buckets, cut
from ref_server.services.config import ServeConfig


def test_buckets_pad_by_at_most_half_above_1024_tokens_and_a_quarter_above_2048():
    assert buckets(8192) == [
        256, 512, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192
    ]  # fmt: skip
    assert buckets(3000) == [256, 512, 1024, 1536, 2048, 2560, 3000]
    assert buckets(512) == [256, 512]
    assert buckets(100) == [100]
    sizes = buckets(8192)
    for n in range(1025, 8193):
        padded = next(size for size in sizes if size >= n)
        assert padded <= (1.25 if n > 2048 else 1.5) * n


def test_a_step_is_cut_into_graph_pieces_around_each_attention_core_and_the_head():
    model = M.from_preset("tiny", seed=0)
    cache = M.PagedKVCache(model.args, 4, 16)
    pieces = cut(model.operations(cache, "prefill"))
    layers = model.args.num_hidden_layers
    assert [p.eager for p in pieces] == [False, True] * (layers + 1)
    eager_names = [[op.name for op in p.ops] for p in pieces if p.eager]
    assert eager_names == [[f"L{i}.attn.core"] for i in range(layers)] + [["head"]]
    first = [op.name for op in pieces[0].ops]
    assert first[:3] == ["embed", "L0.comm_prepare_attn", "L0.attn.prepare"]
    second = [op.name for op in pieces[2].ops]
    assert second[0] == "L0.comm_prepare_mlp" and second[-1] == "L1.attn.prepare"


def test_prefill_graphs_refuse_sparse_attention():
    model = M.from_preset("v3.2-tiny", seed=0)
    with pytest.raises(ValueError, match=r"do not take DeepSeek-V3\.2's sparse attention yet"):
        M.PrefillGraphs(model, M.PagedKVCache(model.args, 4, 16))


def test_prefill_graphs_refuse_a_cache_off_the_gpu():
    model = M.from_preset("tiny", seed=0)
    with pytest.raises(ValueError, match="CUDA graphs need the cache on a CUDA device, not cpu"):
        M.PrefillGraphs(model, M.PagedKVCache(model.args, 4, 16))


def test_serve_refuses_a_negative_prefill_graph_size():
    with pytest.raises(ValueError, match="prefill_graph_tokens must be >= 0, got -1"):
        ServeConfig(prefill_graph_tokens=-1)
    assert ServeConfig(prefill_graph_tokens=0).prefill_graph_tokens == 0


def test_an_engine_on_the_cpu_prefills_eagerly():
    from ref_server.engine import Engine, SchedulerConfig

    model = M.from_preset("tiny", seed=0)
    engine = Engine(model, SchedulerConfig(num_blocks=8, block_size=16, max_model_len=64))
    assert engine.runner.prefill_graphs is None
