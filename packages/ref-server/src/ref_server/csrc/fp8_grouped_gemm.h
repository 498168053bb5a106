// The block-scaled FP8 GEMM over groups of rows (CUTLASS's sm90 warp-specialized grouped kernel
// with blockwise scaling): plain parameters, no torch, so that nvcc compiles it anywhere.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ref_server {

// out[rows of group g] = x[rows of g] @ w[g]^T in bf16 with fp32 accumulation, where for each
// block kb of 128 channels the partial product is scaled by x_scales[row, kb] * w_scales[g,
// col / 128, kb]. Which rows group g holds:
// - offsets given (grouped, prefill): [offsets[g - 1], offsets[g]) (offsets[-1] = 0), clamped
//   to [0, rows];
// - else (batched, decode; dense is one group of all rows): [g * group_rows, g * group_rows +
//   m), m = counts[g] clamped to [0, group_rows], or group_rows without counts.
// Rows of no group are not written.
struct GroupedGemmParams {
  const void* x;           // e4m3 [rows, k], row-major
  const float* x_scales;   // [rows, ceil(k / 128)], row-major
  const void* w;           // e4m3 [groups, n, k], row-major
  const float* w_scales;   // [groups, ceil(n / 128), ceil(k / 128)], row-major
  const int32_t* offsets;  // [groups], cumulative ends, or nullptr
  const int32_t* counts;   // [groups] (batched), or nullptr
  void* out;               // bf16 [rows, n], row-major
  int rows, n, k, groups;  // n and k multiples of 16
  int group_rows;          // rows of each group's block (batched)
  void* arrays;            // grouped_gemm_arrays_bytes(groups) of device memory, 16-byte aligned
  void* workspace;         // grouped_gemm_workspace_bytes(...) of device memory
  int sm_count;
  cudaStream_t stream;
};

size_t grouped_gemm_arrays_bytes(int groups);
size_t grouped_gemm_workspace_bytes(const GroupedGemmParams& params);
// Fills params.arrays on the device from the group sizes, then launches the GEMM; nothing waits
// for the device, so a CUDA graph can capture it. Returns nullptr or what went wrong.
const char* grouped_gemm(const GroupedGemmParams& params);

}  // namespace ref_server
