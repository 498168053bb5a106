"""Weights: random from a seed, or a Hugging Face DeepSeek-V3 checkpoint directory.

A checkpoint is `config.json` plus safetensors files (one, or shards named by
`model.safetensors.index.json`). Tensors are read memory-mapped, one at a time, straight into
the model's parameters. FP8 e4m3 weights come with `weight_scale_inv`, one fp32 scale per
128 x 128 block: a model that keeps its projections in FP8 (`fp8.use_fp8`) keeps them so, and
quantizes bf16 ones the same way; any other model gets them dequantized. Routed experts this
rank does not hold are not read. Layer `num_hidden_layers` is DeepSeek-V3's multi-token-prediction
module (`ref_server.model.mtp`): loaded where the checkpoint has it, but for its copies of the
embedding and head, which are the model's.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from ref_server.kernels.fp8_cast import blocks, dequantize_blocks, quantize_blocks
from ref_server.model.args import ModelArgs
from ref_server.model.transformer import Transformer


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: what is wrong and where."""


def read_config(path: Path) -> ModelArgs:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        return ModelArgs.from_hf_config(json.loads(config_file.read_text()))
    except (KeyError, TypeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{config_file}: not a DeepSeek-V3 config ({error!r})") from error


def without_absent_mtp(args: ModelArgs, path: Path) -> ModelArgs:
    """args without the MTP module when the checkpoint's config names one that its weights
    lack (a checkpoint saved without it, as transformers saves DeepSeek-V3)."""
    mtp = f"model.layers.{args.num_hidden_layers}.eh_proj.weight"
    if args.num_nextn_predict_layers and mtp not in weight_files(path):
        return dataclasses.replace(args, num_nextn_predict_layers=0)
    return args


def weight_files(path: Path) -> dict[str, Path]:
    """Checkpoint tensor name to the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise CheckpointError(f"{index.name} names {file.name}, which is not in {path}")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{path} has no .safetensors files")
    files = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            files |= dict.fromkeys(f.keys(), shard)
    return files


def checkpoint_tensors(
    model: Transformer,
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(checkpoint name, the model tensor or the view of it that the checkpoint tensor fills,
    the view its block scales fill where the model keeps it in FP8, else None) for every
    tensor of the model. A layer that stacks several (`RowParts`) is one view per part.
    Stacked routed experts are one view per slot and projection, named by the logical expert
    the slot holds (replicas read the same tensor)."""
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    stacked = {
        name: module.row_parts
        for name, module in model.named_modules()
        if getattr(module, "row_parts", None) is not None
    }
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv") or ".location." in name:
            continue  # filled with its weight; where the experts are is not in checkpoints
        scale = tensors.get(name + "_scale_inv")
        module_name, name = name, checkpoint_name(model, name)
        parts = name.split(".")
        owner = module_name.rpartition(".")[0]
        if owner in stacked:
            prefix = name.rpartition(".")[0].rpartition(".")[0]
            for part, weight, part_scale in stacked[owner].views(tensor, scale):
                yield f"{prefix}.{part}.weight", weight, part_scale
            continue
        if parts[3:5] != ["mlp", "experts"]:
            yield name, tensor, scale
            continue
        moe_name = module_name.split(".experts.")[0]
        moe = model.get_submodule(moe_name)
        experts = moe.slot_experts()
        for e in range(tensor.shape[0]):
            prefix = f"{checkpoint_name(model, moe_name)}.experts.{experts[e]}."
            if parts[5] != "gate_up_proj":
                yield prefix + parts[5] + ".weight", tensor[e], None if scale is None else scale[e]
                continue
            scales = None if scale is None else scale[e]
            for part, weight, part_scale in moe.experts.gate_up_parts.views(tensor[e], scales):
                yield f"{prefix}{part}.weight", weight, part_scale


def checkpoint_name(model: Transformer, name: str) -> str:
    """The checkpoint's name of the model's tensor or module `name` (the MTP module's are those
    of layer num_hidden_layers)."""
    if name.startswith("mtp."):
        name = f"layers.{model.args.num_hidden_layers}." + name.removeprefix("mtp.")
    return name if name.startswith("lm_head.") else "model." + name


def checked_scales(name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """An FP8 weight's `weight_scale_inv` as fp32: one scale per 128 x 128 block of the weight
    `[out, in]`, so `[ceil(out/128), ceil(in/128)]`."""
    expected = [blocks(n) for n in weight.shape]
    if list(scale_inv.shape) != expected:
        raise CheckpointError(f"{name}: {list(scale_inv.shape)}, expected {expected}")
    return scale_inv.float()


def load_weights(
    model: Transformer, path: Path, wanted: Callable[[str], bool] = lambda name: True
) -> None:
    """Every model tensor (whose checkpoint name is `wanted`) from the checkpoint at `path`.
    FP8 checkpoint weights stay FP8 where the model keeps them so and are dequantized
    elsewhere; other weights are quantized (`quantize_blocks`) where the model keeps them in
    FP8."""
    files = weight_files(path)
    missing, wrong = [], []
    with ExitStack() as stack, torch.no_grad():
        handles = {}

        def read(name: str) -> torch.Tensor:
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            return handles[file].get_tensor(name)

        for source, target, target_scale in checkpoint_tensors(model):
            if not wanted(source):
                continue
            if source not in files:
                missing.append(source)
                continue
            value, scale = read(source), None
            if value.dtype == torch.float8_e4m3fn:
                scale_name = source.removesuffix("weight") + "weight_scale_inv"
                if scale_name not in files:
                    raise CheckpointError(f"{source} is FP8 but {scale_name} is missing")
                scale = checked_scales(scale_name, value, read(scale_name))
                if target_scale is None:
                    value = dequantize_blocks(value, scale)
            elif target_scale is not None:
                value, scale = quantize_blocks(value)
            if value.shape != target.shape:
                wrong.append(f"{source}: {list(value.shape)}, model {list(target.shape)}")
                continue
            target.copy_(value)
            if target_scale is not None:
                target_scale.copy_(scale)
    if missing or wrong:
        listing = [f"missing: {m}" for m in missing[:10]] + [f"shape: {w}" for w in wrong[:10]]
        more = len(missing) + len(wrong) - len(listing)
        raise CheckpointError(
            f"{path} does not match the model of its config.json "
            f"({len(missing)} missing, {len(wrong)} of the wrong shape):\n  "
            + "\n  ".join(listing)
            + (f"\n  ... and {more} more" if more > 0 else "")
        )


def init_random(
    model: Transformer, seed: int, wanted: Callable[[str], bool] = lambda name: True
) -> None:
    """Weights (those whose checkpoint name is `wanted`) from `seed`: N(0, 1/fan_in) for
    projections (divided by sqrt(2 x layers) for those that write into the residual stream),
    N(0, 1) for embeddings, ones for norms (zeros for their biases), zeros for the routing
    bias. Each tensor draws from its own generator on its device, seeded from (seed, its
    checkpoint name): ranks on one kind of device agree. FP8 weights are drawn in the model's
    dtype, then quantized: the weights of the model without FP8, rounded."""
    dtype = model.embed_tokens.weight.dtype
    with torch.no_grad():
        for name, tensor, scale in checkpoint_tensors(model):
            if not wanted(name):
                continue
            generator = torch.Generator(tensor.device).manual_seed(hash_seed(seed, name))
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            elif name.endswith(("e_score_correction_bias", "norm.bias")):
                tensor.zero_()
            else:
                std = 1.0 if "embed_tokens" in name else tensor.shape[-1] ** -0.5
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std /= (2 * model.args.num_hidden_layers) ** 0.5  # a calm residual stream
                if scale is None:
                    tensor.normal_(0.0, std, generator=generator)
                    continue
                dense = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
                values, scales = quantize_blocks(dense.normal_(0.0, std, generator=generator))
                tensor.copy_(values)
                scale.copy_(scales)


def hash_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def reload_experts(model, moe, experts: list[int]) -> None:
    """Load the slots of `moe` (a MoE layer of `model`) that hold these logical experts again,
    from where the model's weights came (`model.weights_from`: its checkpoint directory, or its
    random weights' seed)."""
    source = model.weights_from
    if source is None:
        raise ValueError("the model's weights came from neither a checkpoint nor a seed")
    moe_name = next(name for name, module in model.named_modules() if module is moe)
    prefix = checkpoint_name(model, moe_name)
    names = tuple(f"{prefix}.experts.{e}." for e in experts)
    wanted = lambda name: name.startswith(names)  # noqa: E731
    if isinstance(source, Path):
        load_weights(model, source, wanted)
    else:
        init_random(model, source, wanted)
