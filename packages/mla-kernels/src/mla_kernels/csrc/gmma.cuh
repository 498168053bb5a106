// One warpgroup-wide matrix multiply-accumulate (wgmma) of shape 64 x N x 16 with both
// operands in shared memory, through CuTe's instruction wrappers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <utility>

namespace mla {

using cute::SM90::GMMA::Major;
using cute::SM90::GMMA::ScaleOut;

template <typename T, int N, Major kMajorA, Major kMajorB>
struct GmmaOp;

#define MLA_GMMA_OP(T, N, NAME)                                                       \
  template <Major kMajorA, Major kMajorB>                                             \
  struct GmmaOp<T, N, kMajorA, kMajorB> {                                             \
    using type = cute::SM90::GMMA::MMA_64x##N##x16_F32##NAME##_SS<kMajorA, kMajorB>; \
  };
MLA_GMMA_OP(__nv_bfloat16, 16, BF16BF16)
MLA_GMMA_OP(__nv_bfloat16, 64, BF16BF16)
MLA_GMMA_OP(__nv_bfloat16, 256, BF16BF16)
MLA_GMMA_OP(__half, 16, F16F16)
MLA_GMMA_OP(__half, 64, F16F16)
MLA_GMMA_OP(__half, 256, F16F16)
#undef MLA_GMMA_OP

template <typename Op, int kRegs, size_t... I>
__device__ __forceinline__ void gmma_unpack(uint64_t a, uint64_t b, float (&d)[kRegs], ScaleOut scale,
                                            std::index_sequence<I...>) {
  Op::fma(a, b, d[I]..., scale);
}

// d[64 x N] (+)= A[64 x 16] * B[16 x N], each operand K- or MN-major (see smem_layout.cuh).
// Each thread of the warpgroup holds N / 2 accumulators.
template <typename T, int N, Major kMajorA, Major kMajorB>
__device__ __forceinline__ void gmma(uint64_t a_desc, uint64_t b_desc, float (&d)[N / 2], bool accumulate) {
  using Op = typename GmmaOp<T, N, kMajorA, kMajorB>::type;
  gmma_unpack<Op>(a_desc, b_desc, d, accumulate ? ScaleOut::One : ScaleOut::Zero,
                  std::make_index_sequence<N / 2>{});
}

// The same with A, 64 x 16 and K-major, in registers: four pairs of T per thread, in the
// PTX ISA's fragment layout for wgmma .m64nNk16 (see raw_tile_layout.h).
template <typename T, int N>
struct GmmaRegisterAOp;
#define MLA_GMMA_RS_OP(T, N, NAME)                                                   \
  template <>                                                                        \
  struct GmmaRegisterAOp<T, N> {                                                     \
    using type = cute::SM90::GMMA::MMA_64x##N##x16_F32##NAME##_RS<Major::K, Major::K>; \
  };
MLA_GMMA_RS_OP(__nv_bfloat16, 16, BF16BF16)
MLA_GMMA_RS_OP(__half, 16, F16F16)
#undef MLA_GMMA_RS_OP

template <typename Op, int kRegs, size_t... I>
__device__ __forceinline__ void gmma_rs_unpack(const uint32_t (&a)[4], uint64_t b, float (&d)[kRegs], ScaleOut scale,
                                               std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], b, d[I]..., scale);
}

template <typename T, int N>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t b_desc, float (&d)[N / 2], bool accumulate) {
  gmma_rs_unpack<typename GmmaRegisterAOp<T, N>::type>(a, b_desc, d, accumulate ? ScaleOut::One : ScaleOut::Zero,
                                                       std::make_index_sequence<N / 2>{});
}

template <int kRegs>
__device__ __forceinline__ void fence_accumulators(float (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) cute::warpgroup_fence_operand(d[i]);
}

}  // namespace mla
