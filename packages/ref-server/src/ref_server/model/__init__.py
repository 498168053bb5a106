"""The DeepSeek-V3-architecture model the reference server runs.

    model = ref_server.model.from_preset("tiny", seed=0)
    model = ref_server.model.from_pretrained("/path/to/checkpoint", dtype=torch.bfloat16)
    logits = model(input_ids)                      # [b, t] -> [b, t, vocab], no cache
    tokens = model.generate([[1, 2, 3]], SamplingParams(max_tokens=8))

See docs/model.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ref_server.model.args import PRESETS, ModelArgs
from ref_server.model.cache import PagedKVCache
from ref_server.model.checkpoint import CheckpointError, init_random, load_weights, read_config
from ref_server.model.cuda_graphs import DecodeGraphs
from ref_server.model.generate import generate
from ref_server.model.sampling import SamplingParams
from ref_server.model.step import StepBatch
from ref_server.model.tokenizer import load_tokenizer
from ref_server.model.transformer import Transformer


class Model(Transformer):
    """`Transformer` with generation and its tokenizer."""

    tokenizer = None

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, **kw):
        return generate(self, prompts, params or SamplingParams(), **kw)


def _build(args: ModelArgs, dtype, device, group: dist.ProcessGroup | None) -> Model:
    expert_parallel = None
    if group is not None and group.size() > 1:
        from ref_server.model.expert_parallel import ExpertParallel

        expert_parallel = ExpertParallel(group, args.n_routed_experts, args.hidden_size)
    with torch.device("meta"):
        model = Model(args, expert_parallel)
    model = model.to_empty(device=device).to(dtype)
    model.eval()
    return model


def from_args(
    args: ModelArgs,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
) -> Model:
    """A model of these hyper-parameters with random weights drawn from `seed`."""
    model = _build(args, dtype, device, group)
    init_random(model, seed)
    model.tokenizer = load_tokenizer(model.args)
    return model


def from_preset(name: str, **kwargs) -> Model:
    """A preset ("tiny", "v2-lite", "v3") with random weights; keywords as `from_args`."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return from_args(PRESETS[name], **kwargs)


def from_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
) -> Model:
    """A Hugging Face DeepSeek-V3 checkpoint directory (FP8 weights are dequantized to dtype).
    With a group of several ranks, each holds its share of the routed experts."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    model = _build(read_config(path), dtype, device, group)
    load_weights(model, path)
    model.tokenizer = load_tokenizer(model.args, path)
    return model


__all__ = [
    "PRESETS",
    "CheckpointError",
    "DecodeGraphs",
    "Model",
    "ModelArgs",
    "PagedKVCache",
    "SamplingParams",
    "StepBatch",
    "from_preset",
    "from_pretrained",
]
