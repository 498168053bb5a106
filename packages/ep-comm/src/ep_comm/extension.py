"""Just-in-time build of the cuda backend's extension (`csrc/`), cached by a hash of the sources.

Built with the CUDA toolkit torch finds, for the GPU present, into `EP_COMM_CACHE_DIR`
(default `~/.cache/ep-comm`); `EP_COMM_BUILD_VERBOSE=1` shows the compiler output.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
NVCC_FLAGS = ["-O3", "-DNDEBUG", "-lineinfo"]


def build_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.iterdir() if p.is_file()):  # low_latency/ builds apart
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(NVCC_FLAGS).encode())
    digest.update(f"{torch.__version__} {torch.version.cuda}".encode())
    return digest.hexdigest()[:16]


def build_args() -> dict:
    """cpp_extension.load's sources, include paths and flags; tools/check_cuda_build.py builds
    from the same."""
    return {
        "sources": [str(p) for p in sorted(CSRC.iterdir()) if p.suffix in (".cu", ".cpp")],
        "extra_include_paths": [str(CSRC)],
        "extra_cflags": ["-O3"],
        "extra_cuda_cflags": NVCC_FLAGS,
    }


@functools.cache
def load_extension():
    """The compiled module (built on first use)."""
    from torch.utils import cpp_extension

    key = build_hash()
    cache = Path(os.environ.get("EP_COMM_CACHE_DIR", Path.home() / ".cache" / "ep-comm"))
    build_dir = cache / key
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"ep_comm_cuda_{key}",
        **build_args(),
        build_directory=str(build_dir),
        verbose=os.environ.get("EP_COMM_BUILD_VERBOSE", "0") == "1",
    )
