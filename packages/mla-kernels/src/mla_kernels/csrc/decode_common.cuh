// Pieces shared by the producer and the consumers of the decode kernel.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cutlass/arch/barrier.h>

#include "gmma.cuh"
#include "params.h"
#include "smem_layout.cuh"
#include "tile_cursor.cuh"

namespace mla {

using cutlass::arch::ClusterBarrier;
using cutlass::arch::ClusterTransactionBarrier;
using cutlass::arch::NamedBarrier;

constexpr int kConsumerThreads = 256;
constexpr int kThreads = kConsumerThreads + 128;  // and a producer warpgroup
constexpr uint32_t kLaunchRegisters = 65536 / kThreads / 8 * 8;  // 168
constexpr int kStages = 2;
constexpr uint64_t kCacheHint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);

// Named barriers (cutlass offsets the ids past its reserved ones).
enum NamedBarriers : uint32_t {
  kQReady = 1,       // Q is in shared memory
  kPReady = 2,       // P and the row factors are in shared memory
  kPFree = 3,        // consumer 1 is done reading them
  kRawRead = 4,      // the FP8 producer has read a tile's raw bytes
  kQFree = 5,        // narrow: both consumers are done with the last sequence's Q
  kWarpgroupSync = 6,  // narrow: + warpgroup index, exchanges inside one consumer
};

template <typename T>
struct SharedStorage {
  T q[kBlockM * kHeadDim];
  T k[kStages][kBlockN * kHeadDim];
  T p[kBlockM * kChunkCols];
  float row_factor[kBlockM];  // per-row factors handed from consumer 0 to consumer 1
  alignas(128) float fp8_scales[kStages][kBlockN * 4];  // FP8: the raw tile's scales, by TMA
  uint64_t k_full[kStages], k_empty[kStages];
  uint64_t raw_full[kStages];  // FP8: a stage's raw tokens have landed
  uint64_t attended[kStages];  // bit r: row r of the stage's tile holds a token to attend
};

template <typename T>
constexpr int shared_bytes() {
  return sizeof(SharedStorage<T>);
}

// The swizzled tiles need 1024-byte alignment. Dynamic shared memory starts at the CTA's
// shared window when there is no static shared memory, which is aligned; checked anyway,
// because there is no room left to realign.
template <typename T, typename Storage = SharedStorage<T>>
__device__ __forceinline__ Storage& shared_storage() {
  extern __shared__ __align__(1024) uint8_t smem[];
  if (smem_address(smem) % 1024 != 0) __trap();
  return *reinterpret_cast<Storage*>(smem);
}

// Where the accumulator fragments of a thread lie: rows `row` and `row + 8`, columns
// 8 * i + col and + 1 for each 8-column group i (the wgmma register layout).
struct Fragment {
  int row, col;
  __device__ explicit Fragment(int tid) : row((tid / 32) * 16 + (tid % 32) / 4), col((tid % 4) * 2) {}
};

// The (query position, head) a row of this CTA's query block stands for; valid is false for
// the padding rows past rows_per_kv. `index` is its row in out / out_accum: s * h_q + h.
struct QueryRow {
  int s, h, index;
  bool valid;
  __device__ QueryRow(const DecodeParams& p, int row, int head) {
    const int r = blockIdx.x * kBlockM + row;
    valid = r < p.rows_per_kv;
    s = r / p.heads_per_kv;
    h = head * p.heads_per_kv + r % p.heads_per_kv;
    index = s * p.h_q + h;
  }
  // The last token this query sees.
  __device__ int last_visible(const DecodeParams& p, int seqlen) const {
    return p.causal ? seqlen - p.s_q + s : INT_MAX;
  }
};

// Rows [0, rows) of this CTA's query block into the swizzled Q tile, zeros past rows_per_kv;
// by `thread` of `threads` cooperating threads.
template <typename T>
__device__ void load_q(const DecodeParams& p, T* sq, int batch, int head, int rows, int thread, int threads) {
  constexpr int kPieces = kHeadDim / 8;
  const T* q = static_cast<const T*>(p.q);
#pragma unroll 4
  for (int i = thread; i < rows * kPieces; i += threads) {
    const int row = i / kPieces, piece = i % kPieces;
    const QueryRow qr(p, row, head);
    uint4 value = make_uint4(0, 0, 0, 0);
    if (qr.valid) {
      const int64_t offset = ((int64_t(batch) * p.s_q + qr.s) * p.h_q + qr.h) * kHeadDim + piece * 8;
      value = __ldg(reinterpret_cast<const uint4*>(q + offset));
    }
    *reinterpret_cast<uint4*>(sq + swizzled_offset(kBlockM, row, piece * 8)) = value;
  }
}

constexpr uint64_t kAllRows = ~0ull;  // kBlockN == 64 rows
static_assert(kBlockN == 64, "a tile's rows are the bits of a uint64_t");

// Zero V's columns of the rows of a tile not `attended`: those slots may hold NaN (past the
// sequence, or left from an earlier tile), and a zero probability times NaN is NaN.
template <typename T>
__device__ void zero_unattended_rows(T* tile, uint64_t attended, int tid) {  // by one warpgroup
  constexpr int kPieces = kHeadDimV / 8;
  for (int i = tid; i < kBlockN * kPieces; i += 128) {
    const int row = i / kPieces, piece = i % kPieces;
    if (!((attended >> row) & 1)) {
      *reinterpret_cast<uint4*>(tile + swizzled_offset(kBlockN, row, piece * 8)) = make_uint4(0, 0, 0, 0);
    }
  }
}

}  // namespace mla
