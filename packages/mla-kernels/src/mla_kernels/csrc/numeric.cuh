// Conversions between float, the 16-bit element types and the FP8 cache layout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace mla {

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return __float2half_rn(v);
  }
}

// Eight e4m3 values times `scale`, as eight T.
template <typename T>
__device__ __forceinline__ uint4 fp8x8_to(uint2 packed, float scale) {
  uint32_t out[4];
  const uint32_t words[2] = {packed.x, packed.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[i / 2] >> (16 * (i % 2)));
    const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&raw));
    out[i] = pack2<T>(v.x * scale, v.y * scale);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Four e4m3 values (the bytes of `packed`, lowest first) as floats, exactly. The upper pair is
// converted where it lies (F2FP's .H1 operand), not shifted down first.
__device__ __forceinline__ float4 fp8x4_to_float4(uint32_t packed) {
  uint32_t low, high;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.rn.f16x2.e4m3x2 %0, lo;\ncvt.rn.f16x2.e4m3x2 %1, hi;\n}"
      : "=r"(low), "=r"(high)
      : "r"(packed));
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&low));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&high));
  return make_float4(a.x, a.y, b.x, b.y);
}

// Eight bf16 values as eight T.
template <typename T>
__device__ __forceinline__ uint4 bf16x8_to(uint4 packed) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return packed;
  } else {
    uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
      words[i] = pack2<T>(v.x, v.y);
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
  }
}

}  // namespace mla
