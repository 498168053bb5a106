"""A model's `kernels` option (`ref_server.kernel_choice`) as the implementations its modules
call, chosen once when the model is built (`resolve`): decode attention through mla_kernels or
FlashMLA, the FP8 GEMMs through `fp8_block_gemm` or DeepGEMM, the expert exchange through
ep_comm or DeepEP. A library that the choice needs and that does not import is an error here,
one line naming it and where to get it, before anything runs."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ref_server.kernel_choice import LIBRARIES, PARTS, KernelsUnavailable, parse, unavailable
from ref_server.kernels.deepseek import DeepGemm
from ref_server.model.attention import MLA_KERNELS, DecodeAttention
from ref_server.model.fp8 import fp8_block_gemm

# Where DeepSeek's libraries run: CUDA (their kernels are sm90's).
DEVICE_TYPES = ("cuda",)


@dataclass(frozen=True)
class KernelSet:
    """What runs each part of one model. spec: the `kernels` value it was built from;
    deepseek: the parts DeepSeek's libraries run (of `kernel_choice.PARTS`); deep_ep: the
    imported DeepEP for `ExpertParallel`, None for ep_comm."""

    spec: str
    deepseek: tuple[str, ...]
    decode_attention: DecodeAttention
    fp8_gemm: Callable
    deep_ep: object = None

    def describe(self) -> str:
        """E.g. "deepseek (FlashMLA for decode attention, DeepGEMM for FP8 GEMMs; ours
        elsewhere)"."""
        if not self.deepseek:
            return f"{self.spec} (ref-server's kernels, mla_kernels, ep_comm)"
        libraries = [f"{LIBRARIES[p].name} for {LIBRARIES[p].runs}" for p in self.deepseek]
        rest = "" if len(self.deepseek) == len(PARTS) else "; ours elsewhere"
        return f"{self.spec} ({', '.join(libraries)}{rest})"


OURS = KernelSet("ours", (), MLA_KERNELS, fp8_block_gemm)


def resolve(
    spec: str, *, device, dtype: torch.dtype, fp8: bool, expert_parallel: bool
) -> KernelSet:
    """The kernels `spec` names for a model on `device` with activations in dtype, FP8 weights
    or not, its experts over several ranks or not. ValueError for a bad value or a part that
    cannot run there; KernelsUnavailable for a library that does not import."""
    choice = parse(spec)
    parts = choice.parts_in(fp8=fp8, expert_parallel=expert_parallel)
    if not parts:
        return KernelSet(spec, (), MLA_KERNELS, fp8_block_gemm)
    where = torch.device(device).type
    if where not in DEVICE_TYPES:
        raise ValueError(f"kernels {spec!r}: DeepSeek's libraries run on CUDA, not on {where}")
    if "gemm" in parts and dtype != torch.bfloat16:
        raise ValueError(
            f"kernels {spec!r}: DeepGEMM's FP8 GEMMs write torch.bfloat16; build the model in "
            f"it, not in {dtype}"
        )
    modules, problems = {}, {}
    for part in parts:
        try:
            modules[part] = importlib.import_module(LIBRARIES[part].module)
        except Exception as error:  # a library that is there but fails: its own error, too
            problems[part] = f"{type(error).__name__}: {error}".splitlines()[0]
    if problems:
        raise KernelsUnavailable(unavailable(parts, spec, problems))
    decode = MLA_KERNELS
    if "attention" in modules:
        decode = DecodeAttention(
            "FlashMLA", modules["attention"], page_sizes=(64,), dtypes=(torch.bfloat16,)
        )
    gemm = DeepGemm(modules["gemm"]) if "gemm" in modules else fp8_block_gemm
    return KernelSet(spec, parts, decode, gemm, modules.get("exchange"))
