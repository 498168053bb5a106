"""Build FlashMLA's sm90 sparse kernels (decode over the FP8 cache, prefill) on the GPU machine as
the module `flashmla_sparse_peer`, the peer `bench_sparse.py --peer` times ours against.

usage: python tools/gpu/build_flashmla_sparse_peer.py FLASHMLA_DIR CUTLASS_INCLUDE BUILD_DIR
  FLASHMLA_DIR     a FlashMLA source snapshot outside this repository (commit 9241ae3 was used) with
                   csrc/{api,params.h,defines.h,utils.h,kerutils,smxx}, csrc/sm90/{helpers.h,decode/
                   sparse_fp8,prefill/sparse} and csrc/sm100's headers
  CUTLASS_INCLUDE  <site-packages>/cutlass_library/source/include (the nvidia-cutlass wheel in .whl)
  BUILD_DIR        put it on PYTHONPATH and set FLASHMLA_SPARSE_PEER=flashmla_sparse_peer

The module registers FlashMLA's own two entry points, `sparse_decode_fwd` and
`sparse_prefill_fwd`. Their sm100 branches are linked to functions that raise, since only sm90 is
built. About as long to build as the dense peer (../shared/peers/flashmla).
"""

import os
import sys
import time

from torch.utils.cpp_extension import load

fm, cutlass, build = (os.path.abspath(a) for a in sys.argv[1:4])
src = f"{fm}/csrc"
os.makedirs(build, exist_ok=True)
api = f"{build}/peer_sparse_api.cpp"
with open(api, "w") as f:
    f.write(r"""#include <pybind11/pybind11.h>
#include "sparse_fwd.h"
#include "sparse_decode.h"
#define NOT_BUILT { TORCH_CHECK(false, "sm100 kernels are not built into this peer"); }
namespace sm100::decode::head64 {
template <ModelType M>
void run_flash_splitkv_mla_fp8_sparse_kernel(const SparseAttnDecodeParams &) NOT_BUILT
}
namespace sm100::fwd::head64 {
template <int D> void run_fwd_phase1_kernel(const SparseAttnFwdParams &) NOT_BUILT
}
namespace sm100::fwd::head128 {
template <int D> void run_fwd_phase1_kernel(const SparseAttnFwdParams &) NOT_BUILT
}
namespace sm100::fwd_for_small_topk::head128 {
template <SparseAttnFwdMode M, int D>
void run_fwd_for_small_topk_phase1_kernel(const SparseFwdArgT<M> &) NOT_BUILT
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
  m.def("sparse_prefill_fwd", &sparse_attn_prefill_interface);
}
""")
cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
inst_d = f"{src}/sm90/decode/sparse_fp8/instantiations"
inst_p = f"{src}/sm90/prefill/sparse/instantiations"
t = time.time()
load(
    name="flashmla_sparse_peer",
    build_directory=build,
    verbose=False,
    sources=[
        api,
        f"{src}/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
        f"{src}/smxx/decode/combine/combine.cu",
    ]
    + [f"{inst_d}/{n}" for n in sorted(os.listdir(inst_d))]
    + [f"{inst_p}/{n}" for n in sorted(os.listdir(inst_p))],
    extra_include_paths=[
        f"{src}/api",
        src,
        f"{src}/kerutils/include",
        f"{src}/sm90",
        f"{cuda_home}/include/cccl",
        cutlass,
        f"{os.path.dirname(cutlass)}/tools/util/include",
    ],
    extra_cflags=[
        "-O3",
        "-std=c++20",
        "-DNDEBUG",
        "-Wno-deprecated-declarations",
        "-DFLASH_MLA_DISABLE_FP16",
    ],
    extra_cuda_cflags=[
        "-O3",
        "-std=c++20",
        "-DNDEBUG",
        "-D_USE_MATH_DEFINES",
        "-Wno-deprecated-declarations",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "--use_fast_math",
        "-gencode",
        "arch=compute_90a,code=sm_90a",
        "-DFLASH_MLA_DISABLE_FP16",
    ],
)
print(f"flashmla_sparse_peer built in {time.time() - t:.0f} s into {build}")
