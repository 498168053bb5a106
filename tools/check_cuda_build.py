"""Compile and link every CUDA extension of the packages, on a machine with nvcc and no GPU.

Compiling each .cu alone misses what only the link sees: a non-inline function defined in a
header that two .cu files include is defined twice, and the extension fails to build on the GPU
machine. Run this before a GPU call that builds changed CUDA code:

    python tools/check_cuda_build.py [--jobs N] [--build-dir DIR] [EXTENSION ...]

with a Python that has torch (the CPU wheel will do: its headers include ATen/cuda and
c10/cuda), the packages, `nvidia-cutlass` (mla-kernels, ref-server), `nvidia-nvshmem-cu13` or
$NVSHMEM_DIR (ep-comm's low-latency library, skipped without it) and the cuBLAS, cuSPARSE and
cuSOLVER headers (the toolkit's, else those of the nvidia-cublas, -cusparse and -cusolver wheels);
docs/development.md shows a setup. $CUDA_HOME (default /usr/local/cuda) is the toolkit.

Each extension is built from its package's own sources, include paths and flags: the ninja file
is the one torch's cpp_extension.load writes for them, compiled with `ninja -j N` and linked by
its link rule (`c++ -shared`, without torch's and CUDA's libraries: a shared object may leave
their symbols undefined, while a symbol defined twice stops the link); their objects stay in the
build directory, so a rerun compiles only what changed. The low-latency library is built by
ep-comm's own nvcc command, device link included. The exit status is the number of extensions
that failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from ep_comm import extension as ep_extension
from ep_comm import nvshmem
from mla_kernels import extension as mla_extension
from ref_server.kernels import cutlass_gemm

ROOT = Path(__file__).resolve().parents[1]
# The CPU wheel has torch's CUDA headers but not the one CMake generates for them, which only says
# whether c10_cuda is a shared library (of no effect on Linux): torch's own switch skips it.
CUDA_CONFIG_HEADER = Path(cpp_extension.include_paths()[0]) / "c10/cuda/impl/cuda_cmake_macros.h"
TORCH_FLAGS = [] if CUDA_CONFIG_HEADER.exists() else ["-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"]
# ATen/cuda/CUDAContext.h includes these; a toolkit of nvcc alone lacks them.
CUDA_LIBRARY_HEADERS = ("cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h")

# cpp_extension.load's arguments and TORCH_CUDA_ARCH_LIST as each package builds on an H100:
# mla-kernels and ref-server ask for sm_90a; ep-comm leaves the list to torch, which picks the
# GPU's capability with PTX ("9.0+PTX").
TORCH_EXTENSIONS = {
    "mla-kernels": (
        lambda: mla_extension.sm90a_build_args(mla_extension.CSRC),
        mla_extension.SM90A_ARCH_LIST,
    ),
    "ref-server": (
        lambda: mla_extension.sm90a_build_args(cutlass_gemm.CSRC),
        mla_extension.SM90A_ARCH_LIST,
    ),
    "ep-comm": (ep_extension.build_args, "9.0+PTX"),
}
LOW_LATENCY = "ep-comm-low-latency"
EXTENSIONS = [*TORCH_EXTENSIONS, LOW_LATENCY]


def use_toolkit() -> None:
    """Show a CPU build of torch the CUDA toolkit, as a CUDA build finds it: its nvcc and headers
    go into the ninja file, and its version makes that file track the headers each .cu includes."""
    cpp_extension.CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if torch.version.cuda is None:
        nvcc = Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc"
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True)
        torch.version.cuda = re.search(r"release (\d+\.\d+)", version.stdout)[1]


def cuda_library_includes() -> list[str]:
    """The folders of the pip wheels' (nvidia-cublas, -cusparse, -cusolver) copies of the
    CUDA_LIBRARY_HEADERS that the toolkit lacks."""
    toolkit = Path(cpp_extension.CUDA_HOME) / "include"
    missing = [header for header in CUDA_LIBRARY_HEADERS if not (toolkit / header).exists()]
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(root) for root in spec.submodule_search_locations] if spec else []
    found = {path.parent for root in roots for h in missing for path in root.glob(f"*/include/{h}")}
    return sorted(str(folder) for folder in found)


def failures(log: str) -> str:
    """Each failed command's target and messages, from ninja's log of every command."""
    blocks = re.findall(r"^FAILED: .*?(?=^\[\d+/\d+\] |^ninja: build stopped|\Z)", log, re.M | re.S)
    return "\n".join(blocks) or log[-4000:]


def build_torch_extension(name: str, build_dir: Path, jobs: int) -> tuple[bool, str]:
    build_args, arch_list = TORCH_EXTENSIONS[name]
    args = build_args()  # before the ninja file: a missing CUTLASS says so here
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension._write_ninja_file_to_build_library(
        path=str(build_dir / "build.ninja"),
        name=name.replace("-", "_"),
        sources=args["sources"],
        extra_cflags=args["extra_cflags"] + TORCH_FLAGS,
        extra_cuda_cflags=args["extra_cuda_cflags"] + TORCH_FLAGS,
        extra_sycl_cflags=[],
        extra_ldflags=[],
        extra_include_paths=args["extra_include_paths"] + cuda_library_includes(),
        with_cuda=True,
        with_sycl=False,
        is_standalone=False,
    )
    run = subprocess.run(
        ["ninja", "-k", "0", "-j", str(jobs)],
        cwd=build_dir,
        capture_output=True,
        text=True,
    )
    (build_dir / "ninja-output.txt").write_text(run.stdout + run.stderr)
    return run.returncode == 0, failures(run.stdout + run.stderr)


def build_low_latency(build_dir: Path) -> tuple[bool, str]:
    build_dir.mkdir(parents=True, exist_ok=True)
    command = nvshmem.nvcc_command("90a", build_dir / "libep_comm_ll.so")
    run = subprocess.run(command, capture_output=True, text=True)
    (build_dir / "nvcc-output.txt").write_text(run.stdout + run.stderr)
    return run.returncode == 0, run.stderr[-4000:]


def extension(name: str) -> str:
    if name not in EXTENSIONS:
        raise argparse.ArgumentTypeError(f"{name!r} is none of {', '.join(EXTENSIONS)}")
    return name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "extensions",
        nargs="*",
        type=extension,
        default=EXTENSIONS,
        help=f"of {', '.join(EXTENSIONS)} (default: all)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="parallel compiles")
    parser.add_argument("--build-dir", type=Path, default=ROOT / "build" / "cuda-check")
    options = parser.parse_args()
    use_toolkit()

    failed = 0
    for name in options.extensions:
        start = time.monotonic()
        build_dir = options.build_dir / name
        try:
            if name == LOW_LATENCY:
                ok, message = build_low_latency(build_dir)
            else:
                ok, message = build_torch_extension(name, build_dir, options.jobs)
        except nvshmem.NvshmemUnavailable as error:
            print(f"{name}: SKIPPED ({error})", flush=True)
            continue
        except RuntimeError as error:  # a missing CUTLASS: the package's message says what to do
            ok, message = False, str(error)
        seconds = time.monotonic() - start
        print(f"{name}: {'PASS' if ok else 'FAIL'} ({seconds:.0f} s, {build_dir})", flush=True)
        if not ok:
            failed += 1
            print(message.rstrip() + "\n", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
