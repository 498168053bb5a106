"""Which implementation runs on a device, and the just-in-time build of the CUDA one.

`MLA_KERNELS_BACKEND` chooses: `auto` (default: the sm_90a kernel on Hopper GPUs, the torch
reference elsewhere), `reference` (always the reference), or `cuda` (the kernel, and an
error where it cannot run). The kernel is compiled on first use with nvcc into
`MLA_KERNELS_CACHE_DIR` (default `~/.cache/mla-kernels`), in a folder named by a hash of the
sources, the flags and the torch/CUDA versions, so a build is reused until one of them changes.
`load_sm90a_ops` is that build for any folder of sources; ref-server builds its GEMM with it.

`MLA_KERNELS_FP8_IN_REGISTERS=1` (experimental, off by default) serves an FP8 cache with at most
16 query rows per KV head by the kernel that dequantizes in its consumers' registers
(`csrc/decode_kernel_fp8_registers.cuh`) instead of the one whose producer dequantizes into a
bf16 stage. It is read at every call, so that tests and benchmarks can compare both in one
process (a CUDA graph keeps the kernel it captured).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
NVCC_FLAGS = [
    "-O3",
    "-DNDEBUG",
    "--use_fast_math",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    "-Xptxas=-v",
]
SM90A_ARCH_LIST = "9.0a"  # TORCH_CUDA_ARCH_LIST: wgmma and setmaxnreg exist only in sm_90a
BACKENDS = ("auto", "reference", "cuda")


def requested_backend() -> str:
    choice = os.environ.get("MLA_KERNELS_BACKEND", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"MLA_KERNELS_BACKEND={choice!r}; expected one of {', '.join(BACKENDS)}")
    return choice


def fp8_in_registers() -> bool:
    """Whether MLA_KERNELS_FP8_IN_REGISTERS selects the experimental narrow FP8 kernel."""
    choice = os.environ.get("MLA_KERNELS_FP8_IN_REGISTERS", "0")
    if choice not in ("0", "1"):
        raise ValueError(f"MLA_KERNELS_FP8_IN_REGISTERS={choice!r}; expected 0 or 1")
    return choice == "1"


def backend(device: torch.device | str) -> str:
    """`"cuda"` when the sm_90a kernel serves tensors on `device`, else `"reference"`."""
    device = torch.device(device)
    choice = requested_backend()
    if choice == "reference":
        return "reference"
    reason = _why_not_cuda(device)
    if reason is None:
        return "cuda"
    if choice == "cuda":
        raise RuntimeError(f"MLA_KERNELS_BACKEND=cuda but {reason}")
    return "reference"


def _why_not_cuda(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"the tensors are on {device.type}, not a CUDA device"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return (
            f"the kernel needs a Hopper GPU (sm_90), this one is sm_{capability[0]}{capability[1]}"
        )
    return None


def cutlass_include() -> Path:
    try:
        import cutlass_library
    except ImportError:
        raise RuntimeError(
            "building the sm_90a kernels needs the CUTLASS headers: pip install nvidia-cutlass "
            "(or set MLA_KERNELS_BACKEND=reference for mla-kernels' reference path)"
        ) from None
    return Path(cutlass_library.__file__).parent / "source" / "include"


def build_hash(csrc: Path = CSRC) -> str:
    """A hash of csrc's files, the flags and the torch/CUDA versions: a build's folder name."""
    digest = hashlib.sha256()
    for path in sorted(p for p in csrc.iterdir() if p.is_file()):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(NVCC_FLAGS).encode())
    digest.update(f"{torch.__version__} {torch.version.cuda}".encode())
    return digest.hexdigest()[:16]


def sm90a_build_args(csrc: Path) -> dict:
    """cpp_extension.load's sources, include paths and flags for every .cu and .cpp file of
    csrc, with the CUTLASS headers; tools/check_cuda_build.py builds from the same."""
    from torch.utils import cpp_extension

    cuda_home = Path(cpp_extension.CUDA_HOME or "/usr/local/cuda")
    return {
        "sources": [str(p) for p in sorted(csrc.iterdir()) if p.suffix in (".cu", ".cpp")],
        "extra_include_paths": [
            str(csrc),
            str(cutlass_include()),
            str(cutlass_include().parent / "tools" / "util" / "include"),
            str(cuda_home / "include" / "cccl"),
        ],
        "extra_cflags": ["-O3"],
        "extra_cuda_cflags": NVCC_FLAGS,
    }


def load_sm90a_ops(name: str, csrc: Path, cache: Path, verbose: bool = False) -> None:
    """Compile (or reuse) every .cu and .cpp file of csrc for sm_90a, with the CUTLASS headers,
    into `cache/<build_hash(csrc)>`, and load the torch ops they register. mla-kernels builds
    its decode kernel so; ref-server its CUTLASS GEMM."""
    from torch.utils import cpp_extension

    key = build_hash(csrc)
    build_dir = cache / key
    build_dir.mkdir(parents=True, exist_ok=True)
    previous_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = SM90A_ARCH_LIST
    try:
        cpp_extension.load(
            name=f"{name}_{key}",
            **sm90a_build_args(csrc),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        if previous_arch_list is None:
            del os.environ["TORCH_CUDA_ARCH_LIST"]
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = previous_arch_list


@functools.cache
def load_extension() -> None:
    """Compile (or reuse) and load the CUDA ops into `torch.ops.mla_kernels_cuda`."""
    cache = Path(os.environ.get("MLA_KERNELS_CACHE_DIR", Path.home() / ".cache" / "mla-kernels"))
    verbose = os.environ.get("MLA_KERNELS_BUILD_VERBOSE", "0") == "1"
    load_sm90a_ops("mla_kernels_cuda", CSRC, cache, verbose)
