"""NVSHMEM for the low-latency `cuda` backend: find it, build our kernels against it, start it.

NVSHMEM comes from `$NVSHMEM_DIR` or the `nvidia-nvshmem-cu12`/`-cu13` wheel matching
`torch.version.cuda` (it ships `include/`, `lib/libnvshmem_host.so.3` under its versioned name
only, `lib/libnvshmem_device.a` and the bootstrap plugins). `csrc/low_latency/` is built by one
nvcc command into a plain shared library (a C ABI, no torch headers) that Python loads with
ctypes; it is cached in `$EP_COMM_CACHE_DIR` (default `~/.cache/ep-comm`) under a hash of the
sources, the flags and the versions. `EP_COMM_BUILD_VERBOSE=1` shows the compiler output.

NVSHMEM is per process: `initialize` starts it once, for one group of PEs, through a unique id
that rank 0 draws and the others receive over the process group.

NVSHMEM's host collectives (init, malloc, free) have no timeout: a peer that dies just before
one blocks it for good. With `EP_COMM_NVSHMEM_WATCHDOG=1` (off until it has run on a GPU),
`collective` runs them on a thread the caller waits for at most `Collectives.device_timeout`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import subprocess
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from ep_comm.collectives import Collectives, EPCommError

SOURCES = Path(__file__).parent / "csrc" / "low_latency"
NVCC_FLAGS = [
    "-rdc=true",
    "-shared",
    "-Xcompiler",
    "-fPIC",
    "-O3",
    "-lineinfo",
    "-cudart",
    "shared",
]
HEAP_MARGIN = 512 << 20


class NvshmemUnavailable(RuntimeError):
    """NVSHMEM could not be found, built against or started; the message says why."""


def nvshmem_dir() -> Path:
    if "NVSHMEM_DIR" in os.environ:
        return Path(os.environ["NVSHMEM_DIR"])
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except ModuleNotFoundError:  # no nvidia-* wheel at all
        spec = None
    if spec is None or not spec.submodule_search_locations:
        cuda = (torch.version.cuda or "12").split(".")[0]
        raise NvshmemUnavailable(
            f"NVSHMEM not found: install nvidia-nvshmem-cu{cuda} or set NVSHMEM_DIR"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _cuda_home() -> Path:
    from torch.utils.cpp_extension import CUDA_HOME

    return Path(CUDA_HOME or os.environ.get("CUDA_HOME", "/usr/local/cuda"))


def gpu_arch() -> str:
    """The current GPU's architecture for nvcc: "90a" on Hopper (wgmma and friends), "100a" on
    Blackwell, else the plain capability."""
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}" + ("a" if major >= 9 else "")


def nvcc_command(arch: str, output: Path) -> list[str]:
    home = nvshmem_dir()
    sources = sorted(str(p) for p in SOURCES.glob("*.cu"))
    return [
        str(_cuda_home() / "bin" / "nvcc"),
        *NVCC_FLAGS,
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        f"-I{home / 'include'}",
        *sources,
        "-o",
        str(output),
        f"-L{home / 'lib'}",
        "-lnvshmem_device",  # the static device library (there is no shared one)
        "-l:libnvshmem_host.so.3",
        "-Xlinker",
        f"-rpath={home / 'lib'}",
    ]


def build_library(arch: str | None = None) -> Path:
    """Build (or find in the cache) the shared library for `arch` (default: this GPU's)."""
    arch = arch or gpu_arch()
    digest = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    versions = f"{arch} {nvshmem_dir()} {torch.__version__} {torch.version.cuda}"
    digest.update((" ".join(NVCC_FLAGS) + versions).encode())
    cache = Path(os.environ.get("EP_COMM_CACHE_DIR", Path.home() / ".cache" / "ep-comm"))
    output = cache / f"low_latency_{digest.hexdigest()[:16]}" / "libep_comm_ll.so"
    if output.exists():
        return output
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_suffix(f".{os.getpid()}.tmp")
    command = nvcc_command(arch, partial)
    run = subprocess.run(command, capture_output=True, text=True)
    if os.environ.get("EP_COMM_BUILD_VERBOSE", "0") == "1":
        print(" ".join(command), run.stdout, run.stderr, sep="\n")
    if run.returncode != 0:
        raise NvshmemUnavailable(
            f"building the low-latency kernels failed:\n{' '.join(command)}\n{run.stderr[-4000:]}"
        )
    partial.replace(output)  # atomic: ranks building at once all end up with a whole file
    return output


@functools.cache
def load() -> ctypes.CDLL:
    """The built library, its C ABI typed (see csrc/low_latency/ll.h)."""
    torch.cuda.init()  # the library shares torch's CUDA runtime, loaded first
    lib = ctypes.CDLL(str(build_library()))
    c_int, c_void_p = ctypes.c_int, ctypes.c_void_p
    signatures = {
        "ep_ll_unique_id_bytes": ([], c_int),
        "ep_ll_get_unique_id": ([c_void_p], c_int),
        "ep_ll_init": ([c_int, c_int, c_void_p], c_int),
        "ep_ll_my_pe": ([], c_int),
        "ep_ll_num_pes": ([], c_int),
        "ep_ll_init_status": ([], c_int),
        "ep_ll_malloc": ([ctypes.c_uint64], c_void_p),
        "ep_ll_free": ([c_void_p], None),
        "ep_ll_barrier_all": ([], None),
        "ep_ll_quiet": ([], c_int),
        "ep_ll_dispatch_send": ([c_void_p, c_void_p, c_int], c_int),
        "ep_ll_dispatch_recv": ([c_void_p, c_void_p], c_int),
        "ep_ll_combine_send": ([c_void_p, c_void_p], c_int),
        "ep_ll_combine_recv": ([c_void_p, c_void_p], c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


# this process's NVSHMEM world once started: its global ranks ("members") and "world", a hash
# of its unique id, the same in every process of that world
_started: dict[str, tuple | int] = {}
_blocked: list[str] = []  # a collective that never returned: NVSHMEM is unusable in this process


def collective(comm: Collectives, step: str, function, *args):
    """function(*args), an NVSHMEM host collective, on this CUDA device: its result. With the
    watchdog on, raise EPCommError instead once `comm.device_timeout` has passed; the call
    stays blocked, and every later one raises at once (only a new process can use NVSHMEM)."""
    where = f"ep_comm rank {comm.rank}/{comm.size}"
    if _blocked:
        raise EPCommError(
            f"{where}: {step}: NVSHMEM is unusable in this process since {_blocked[0]} never "
            "returned (restart the process)"
        )
    if os.environ.get("EP_COMM_NVSHMEM_WATCHDOG", "0") != "1":
        return function(*args)
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    outcome = {}

    def call() -> None:
        try:
            if device is not None:  # the current device is per thread
                torch.cuda.set_device(device)
            outcome["result"] = function(*args)
        except BaseException as error:  # raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=call, name=f"ep_comm: {step}", daemon=True)
    thread.start()
    timeout = comm.device_timeout.total_seconds()
    thread.join(timeout)
    if thread.is_alive():
        _blocked.append(step)
        raise EPCommError(
            f"{where}: {step} did not return within {timeout:g} s (a peer died or hangs); "
            "NVSHMEM is unusable in this process from now on (restart the process)"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _set_environment(heap_bytes: int) -> None:
    # Multicast (NVLS) is forbidden on the shared GPU hosts we run on: never let NVSHMEM use it.
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap_bytes + HEAP_MARGIN))
    plugin = nvshmem_dir() / "lib" / "nvshmem_bootstrap_uid.so.3"
    if plugin.exists():
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_PLUGIN", str(plugin))


def why_not_start(members: tuple[int, ...]) -> str | None:
    """Why NVSHMEM cannot run for a group of these global ranks in this process: it runs for
    another group already (it starts once per process); None where it can."""
    if _started and _started["members"] != tuple(members):
        return (
            f"NVSHMEM already runs in this process for the group of global ranks "
            f"{list(_started['members'])}, not {list(members)} (it starts once per process)"
        )
    return None


def world() -> int:
    """This process's NVSHMEM world, as its processes alone share it (a hash of its unique
    id); 0 where NVSHMEM has not started. Ranks with the same global ranks may still be other
    processes: one that replaced a lost rank has none while its peers keep theirs."""
    return _started.get("world", 0)


def initialize(comm: Collectives, heap_bytes: int) -> ctypes.CDLL:
    """Start NVSHMEM on the current CUDA device with every rank of `comm` as a PE (once per
    process; later calls check they ask for the same world). `heap_bytes`: what this process
    will allocate, for `NVSHMEM_SYMMETRIC_SIZE` unless that is set already."""
    lib = load()
    members = tuple(dist.get_process_group_ranks(comm.group))
    if _started:
        why = why_not_start(members)
        if why:
            raise ValueError(f"a low-latency Buffer with the cuda backend cannot start: {why}")
        return lib
    _set_environment(heap_bytes)
    id_bytes = lib.ep_ll_unique_id_bytes()
    unique_id = (ctypes.c_uint8 * id_bytes)()
    if comm.rank == 0:
        status = lib.ep_ll_get_unique_id(unique_id)
        if status != 0:
            raise NvshmemUnavailable(f"nvshmemx_get_uniqueid failed (status {status})")
    local = torch.frombuffer(bytearray(unique_id), dtype=torch.uint8)
    gathered = comm.all_gather("low-latency Buffer(): exchange the NVSHMEM unique id", local)
    unique_id = (ctypes.c_uint8 * id_bytes).from_buffer_copy(bytes(gathered[0].tolist()))
    step = "low-latency Buffer(): start NVSHMEM"
    status = collective(comm, step, lib.ep_ll_init, comm.rank, comm.size, unique_id)
    if status != 0:
        raise NvshmemUnavailable(
            f"NVSHMEM did not start on rank {comm.rank}/{comm.size} (status {status}; "
            "NVSHMEM_DEBUG=INFO says why)"
        )
    if (lib.ep_ll_my_pe(), lib.ep_ll_num_pes()) != (comm.rank, comm.size):
        raise NvshmemUnavailable(
            f"NVSHMEM started as PE {lib.ep_ll_my_pe()} of {lib.ep_ll_num_pes()}, "
            f"expected {comm.rank} of {comm.size}"
        )
    _started["members"] = members
    digest = hashlib.blake2b(bytes(unique_id), digest_size=7).digest()
    _started["world"] = int.from_bytes(digest, "little") + 1
    return lib
