// The split-KV tile schedule (mla_kernels/scheduler.py's arithmetic) in one kernel of one
// block: where the reference launches some thirty small ops a decode step, this is one.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"

namespace mla {

constexpr int kScheduleThreads = 1024;
constexpr int64_t kFixedOverheadBlocks = 5;  // scheduler.FIXED_OVERHEAD_BLOCKS

// Python's floor division by a positive divisor (the reference's `//` on int64 tensors).
__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t d) { return a >= 0 ? a / d : -((-a + d - 1) / d); }

// Elements of the sorted `values[0, n)` at most `x` (torch.searchsorted, right=True).
__device__ __forceinline__ int64_t count_at_most(const int64_t* values, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (values[mid] <= x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Elements of the sorted `values[0, n)` below `x` (torch.searchsorted, right=False).
__device__ __forceinline__ int64_t count_below(const int64_t* values, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (values[mid] < x) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// out[i] = value(0) + ... + value(i - 1) for i in [0, n], by the whole block: each thread sums
// a contiguous chunk, the chunk sums are scanned in shared memory, then each chunk is written.
template <typename Out, typename Value>
__device__ void block_exclusive_scan(int64_t n, Value value, Out* out, int64_t* partial) {
  const int t = threadIdx.x;
  const int64_t chunk = (n + blockDim.x - 1) / blockDim.x;
  const int64_t lo = min(n, t * chunk), hi = min(n, lo + chunk);
  int64_t sum = 0;
  for (int64_t i = lo; i < hi; ++i) sum += value(i);
  partial[t] = sum;
  __syncthreads();
  for (int offset = 1; offset < blockDim.x; offset <<= 1) {
    const int64_t add = t >= offset ? partial[t - offset] : 0;
    __syncthreads();
    partial[t] += add;
    __syncthreads();
  }
  int64_t running = t == 0 ? 0 : partial[t - 1];
  for (int64_t i = lo; i < hi; ++i) {
    out[i] = static_cast<Out>(running);
    running += value(i);
  }
  if (t == blockDim.x - 1) out[n] = static_cast<Out>(partial[t]);
  __syncthreads();
}

__global__ void __launch_bounds__(kScheduleThreads) schedule_kernel(ScheduleParams p) {
  __shared__ int64_t partial[kScheduleThreads];
  const int64_t b = p.batch, parts = p.num_parts;
  int64_t* block_start = p.workspace;        // [b + 1]
  int64_t* cost_start = block_start + b + 1;  // [b + 1]
  int64_t* cuts = cost_start + b + 1;         // [parts + 1]: where each partition starts
  int64_t* first = cuts + parts + 1;          // [b]: the first partition touching a sequence
  int64_t* pieces = first + b;                // [b]
  const auto blocks = [&](int64_t i) { return floor_div(int64_t{p.cache_seqlens[i]} + int64_t{kSchedBlock} - 1, int64_t{kSchedBlock}); };
  const auto overhead = [&](int64_t i) { return blocks(i) > 0 ? kFixedOverheadBlocks : int64_t{0}; };

  block_exclusive_scan(b, blocks, block_start, partial);
  block_exclusive_scan(b, [&](int64_t i) { return blocks(i) + overhead(i); }, cost_start, partial);
  const int64_t total = cost_start[b];
  const int64_t per_part = max(int64_t{1}, floor_div(total + parts - 1, parts));

  for (int64_t part = threadIdx.x; part <= parts; part += blockDim.x) {
    const int64_t point = min(part * per_part, total);
    const int64_t owner = count_at_most(cost_start + 1, b, point);
    const int64_t clamped = min(owner, b - 1);
    int64_t into = max(int64_t{0}, point - cost_start[clamped] - overhead(clamped));
    into = min(into, blocks(clamped));
    cuts[part] = owner < b ? block_start[clamped] + into : block_start[b];
  }
  __syncthreads();

  for (int64_t i = threadIdx.x; i < b; i += blockDim.x) {
    first[i] = count_at_most(cuts + 1, parts, block_start[i]);
    const int64_t last = count_below(cuts, parts, block_start[i + 1]) - 1;
    pieces[i] = blocks(i) > 0 ? last - first[i] + 1 : 0;
  }
  __syncthreads();
  block_exclusive_scan(b, [&](int64_t i) { return pieces[i]; }, p.splits, partial);

  for (int64_t part = threadIdx.x; part < parts; part += blockDim.x) {
    const int64_t begin = cuts[part], end = cuts[part + 1];
    const int64_t begin_batch = count_at_most(block_start + 1, b, begin);
    const int64_t end_batch = count_at_most(block_start + 1, b, end - 1);
    const int64_t begin_clamped = min(begin_batch, b - 1);
    const int64_t begin_block = begin - block_start[begin_clamped];
    const int64_t end_block = end - block_start[min(end_batch, b - 1)];
    int* row = p.metadata + part * kMetadataWidth;
    row[0] = static_cast<int>(begin_batch);
    row[1] = static_cast<int>(begin_block);
    row[2] = static_cast<int>(end > begin ? end_batch : begin_batch - 1);
    row[3] = static_cast<int>(end_block);
    row[4] = static_cast<int>(begin_block > 0 ? part - first[begin_clamped] : 0);
  }
}

}  // namespace mla
