"""The DeepSeek-V3-architecture model the reference server runs.

    model = ref_server.model.from_preset("tiny", seed=0)
    model = ref_server.model.from_pretrained("/path/to/checkpoint", dtype=torch.bfloat16)
    model = ref_server.model.from_pretrained(path, weight_dtype="fp8")  # projections in FP8
    model = ref_server.model.from_preset("v2-lite", device="cuda", kernels="deepseek")  # FlashMLA
    logits = model(input_ids)                      # [b, t] -> [b, t, vocab], no cache
    tokens = model.generate([[1, 2, 3]], SamplingParams(max_tokens=8))

See docs/model.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ref_server.model.args import PRESETS, ModelArgs
from ref_server.model.cache import PagedKVCache, cache_bytes_per_token, cache_page_bytes
from ref_server.model.checkpoint import (
    CheckpointError,
    init_random,
    load_weights,
    read_config,
    without_absent_mtp,
)
from ref_server.model.cuda_graphs import DecodeGraphs
from ref_server.model.expert_location import default_placement
from ref_server.model.expert_rebalance import expert_tensors
from ref_server.model.fp8 import FP8Experts, FP8Linear, use_fp8
from ref_server.model.generate import generate
from ref_server.model.kernel_set import KernelSet, resolve
from ref_server.model.mtp import MTP
from ref_server.model.prefill_graphs import PrefillGraphs
from ref_server.model.sampling import SamplingParams
from ref_server.model.step import StepBatch
from ref_server.model.tokenizer import load_tokenizer
from ref_server.model.transformer import Transformer


class Model(Transformer):
    """`Transformer` with generation and its tokenizer."""

    tokenizer = None
    weights_from: Path | int | None = None  # the checkpoint directory, or the random weights' seed

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, **kw):
        return generate(self, prompts, params or SamplingParams(), **kw)


WEIGHT_DTYPES = (None, "fp8")


def _build(
    args: ModelArgs,
    dtype,
    device,
    group: dist.ProcessGroup | None,
    weight_dtype: str | None,
    num_physical_experts: int | None = None,
    expert_placement=None,
    exchange=None,
    kernels: str = "ours",
    joining: tuple[int, int] | None = None,
) -> Model:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype {weight_dtype!r}: expected None (dtype) or 'fp8'")
    placement = None
    if expert_placement is not None:
        placement = torch.as_tensor(expert_placement, dtype=torch.long)
        rows = {args.num_moe_layers, args.num_moe_layers + args.num_nextn_predict_layers}
        if placement.dim() != 2 or placement.shape[0] not in rows:
            with_mtp = " (and one for the MTP module's)" if len(rows) > 1 else ""
            raise ValueError(
                f"an expert placement needs a row per MoE layer ({args.num_moe_layers})"
                f"{with_mtp}, got shape {tuple(placement.shape)}"
            )
        num_physical_experts = num_physical_experts or placement.shape[1]
        if placement.shape[1] != num_physical_experts:
            raise ValueError(
                f"the placement has {placement.shape[1]} slots per layer, not the "
                f"{num_physical_experts} physical experts asked for"
            )
    slots = num_physical_experts or args.n_routed_experts
    split = exchange is None and (joining or (group is not None and group.size() > 1))
    chosen = resolve(
        kernels, device=device, dtype=dtype, fp8=weight_dtype == "fp8", expert_parallel=split
    )
    expert_parallel = exchange
    if split:
        from ref_server.model.expert_parallel import ExpertParallel

        expert_parallel = ExpertParallel(
            group, slots, args.hidden_size, deep_ep=chosen.deep_ep, joining=joining
        )
    with torch.device("meta"):
        model = Model(args, expert_parallel, num_physical_experts, chosen)
        if args.num_nextn_predict_layers:
            model.mtp = MTP(args, expert_parallel, num_physical_experts, chosen.decode_attention)
        model = model.to(dtype)
        if weight_dtype == "fp8":
            use_fp8(model, chosen.fp8_gemm)  # after .to(dtype), which would convert FP8 tensors
    model = model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, (FP8Linear, FP8Experts)):
            module.zero_padding()
    default = default_placement(args.n_routed_experts, slots)
    for i, moe in enumerate(model.moe_layers(mtp=True)):
        if moe.location is not None:
            # a placement without the MTP module's row leaves its experts as by default
            moe.location.place(
                default if placement is None or i >= len(placement) else placement[i]
            )
            moe.location.take_load(moe.first_slot)  # zero the counts
        if joining:  # its experts come when it is admitted (`_to_load`); until then, zeros
            with torch.no_grad():
                for tensor in expert_tensors(moe.experts):
                    tensor.zero_()
    model.eval()
    return model


def from_args(
    args: ModelArgs,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    weight_dtype: str | None = None,
    num_physical_experts: int | None = None,
    expert_placement=None,
    exchange=None,
    kernels: str = "ours",
    joining: tuple[int, int] | None = None,
) -> Model:
    """A model of these hyper-parameters with random weights drawn from `seed`, in `dtype`
    (activations, and weights unless weight_dtype is "fp8": then the projections are FP8,
    the same random weights quantized in 128 x 128 blocks). Expert slots and kernels as
    `from_pretrained`; replicas of an expert get its weights. exchange: what the MoE layers
    exchange rows through instead of an `ExpertParallel` over group: a stand-in with its
    interface, such as `ref_server.repro.slices.LayoutExchange` (one rank of a layout, without
    its peers). joining: as `from_pretrained`."""
    model = _build(
        args, dtype, device, group, weight_dtype, num_physical_experts, expert_placement,
        exchange, kernels, joining,
    )  # fmt: skip
    init_random(model, seed, _to_load(joining))
    model.weights_from = seed
    model.tokenizer = load_tokenizer(model.args)
    return model


def _to_load(joining: tuple[int, int] | None) -> Callable[[str], bool]:
    """Which weights (by checkpoint name) a model loads: a joining rank's routed experts come
    from the instance when it is admitted (`regroup_experts`), so it skips them."""
    if joining is None:
        return lambda name: True
    return lambda name: ".mlp.experts." not in name


def from_preset(name: str, *, mtp: bool = False, **kwargs) -> Model:
    """A preset ("tiny", "v2-lite", "v3") with random weights; mtp: with DeepSeek-V3's MTP
    module (`ref_server.model.mtp`) for speculative decoding; keywords as `from_args`."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    args = dataclasses.replace(PRESETS[name], num_nextn_predict_layers=int(mtp))
    return from_args(args, **kwargs)


def from_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    weight_dtype: str | None = None,
    num_physical_experts: int | None = None,
    expert_placement=None,
    kernels: str = "ours",
    joining: tuple[int, int] | None = None,
) -> Model:
    """A Hugging Face DeepSeek-V3 checkpoint directory, activations in `dtype`. weight_dtype
    None: weights in dtype too (FP8 ones dequantized); "fp8": the projections DeepSeek stores
    in FP8 (attention, dense and shared MLPs, routed experts) stay e4m3 with their 128 x 128
    block scales, and bf16 ones are quantized so. With a group of several ranks, each holds
    its share of the routed experts' slots.

    num_physical_experts: expert slots per MoE layer, for balancing (docs/balance.md); at
    least the routed experts, a multiple of the ranks; slot p holds expert p % E unless
    expert_placement `[MoE layers, slots]` says which (`balance.Placement.phy2log`).

    kernels: "ours" (ref-server's kernels, mla_kernels, ep_comm), "deepseek" (FlashMLA for
    decode attention, DeepGEMM for the FP8 GEMMs, DeepEP for the exchange: each where the model
    has that part) or "deepseek:PART[,PART...]" (those parts alone); see
    `ref_server.kernel_choice` and docs/model.md. `model.kernels` says what runs.

    joining (rank, ranks) instead of a group: built as that rank of an expert-parallel
    instance it joins later (`ref_server.services.elastic`), with no group until then; its
    routed experts' slots stay unloaded (the instance fills each as it admits the rank)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    model = _build(
        without_absent_mtp(read_config(path), path),
        dtype,
        device,
        group,
        weight_dtype,
        num_physical_experts,
        expert_placement,
        kernels=kernels,
        joining=joining,
    )
    load_weights(model, path, _to_load(joining))
    model.weights_from = path
    model.tokenizer = load_tokenizer(model.args, path)
    return model


__all__ = [
    "PRESETS",
    "CheckpointError",
    "DecodeGraphs",
    "KernelSet",
    "Model",
    "ModelArgs",
    "PagedKVCache",
    "PrefillGraphs",
    "SamplingParams",
    "StepBatch",
    "cache_bytes_per_token",
    "cache_page_bytes",
    "from_preset",
    "from_pretrained",
]
