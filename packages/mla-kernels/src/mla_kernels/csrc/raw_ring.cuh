// The ring of raw FP8 tiles of the kernel that dequantizes in registers
// (decode_kernel_fp8_registers.cuh): its shared memory and the thread that fills it.
//
// kRawStages raw tiles (raw_tile_layout.h), each with a "full" mbarrier (the producer's arrival
// and the TMA bytes) and an "empty" one (the 128 threads of the consumer that read it). Tile j of
// a partition goes to stage j % kRawStages and to consumer j % 2. Rows of a tile with no token to
// attend (past its length, or on a page the block table gives no cache block) are not copied;
// the tile's `attended` bits say which rows are.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>

#include "decode_common.cuh"
#include "producer.cuh"
#include "raw_tile_layout.h"

namespace mla {

constexpr int kRawStages = 4;
constexpr int kNarrowRows = 16;  // query rows per KV head, at most

template <typename T>
struct RawRingStorage {
  alignas(1024) uint8_t stage[kRawStages][raw_tile::kStageBytes];
  T q[kNarrowRows * kHeadDim];  // swizzled chunks of 16 rows; dim d in column raw_tile::q_column(d)
  T p[2][kNarrowRows * kChunkCols];  // each consumer's P^T: 16 query rows x 64 positions
  float maxima[2][4][kNarrowRows], sums[2][4][kNarrowRows];  // [consumer][warp][query row]
  uint64_t full[kRawStages], empty[kRawStages];
  uint64_t attended[kRawStages];  // bit r: row r of the stage's tile holds a token to attend
};
static_assert(raw_tile::kStageBytes % 1024 == 0 && sizeof(RawRingStorage<__half>::q) % 1024 == 0,
              "the swizzled chunks must start at 1024-byte boundaries");
static_assert(sizeof(RawRingStorage<__half>) <= 227 * 1024, "more shared memory than a CTA may have");

// mbarrier waits and arrivals that also keep the compiler from moving plain shared-memory
// accesses across them: the consumers read the raw tiles with ordinary loads.
__device__ __forceinline__ void wait_then_read(uint64_t* barrier, uint32_t parity) {
  ClusterBarrier::wait(barrier, parity);
  asm volatile("" ::: "memory");
}

__device__ __forceinline__ void arrive_after_reads(uint64_t* barrier) {
  asm volatile("" ::: "memory");
  ClusterBarrier::arrive(barrier);
}

// By one thread: each tile's cache slots (their block-table loads overlap the wait for the
// stage), then its TMA copies: per page-sized box, four latent chunks, the rope, the scales.
template <typename T>
__device__ void produce_raw_tiles(const DecodeParams& p, RawRingStorage<T>& s, int head) {
  constexpr int kMaxBoxes = kBlockN / 16;  // pages of 16 tokens or more
  constexpr int kRopeColumn = (kFp8TokenBytes - 128) / 2;  // in the 16-bit view of kv_tensor_map
  const int box_rows = min(p.page_size, kBlockN);
  const uint64_t box_bits = box_rows == kBlockN ? kAllRows : (1ull << box_rows) - 1;
  int j = 0;
  for (TileCursor tile(p, blockIdx.z); !tile.done(); tile.advance(), ++j) {
    const int stage = j % kRawStages, length = tile.length();
    uint64_t attended = length == kBlockN ? kAllRows : (1ull << length) - 1;
    int slots[kMaxBoxes], copied = 0;
#pragma unroll
    for (int i = 0; i < kMaxBoxes; ++i) {
      const int row = i * box_rows;
      slots[i] = row < length ? cache_slot(p, tile.batch, tile.token + row) : -1;
      if (row < length && slots[i] < 0) attended &= ~(box_bits << row);
      copied += slots[i] >= 0;
    }
    ClusterBarrier::wait(&s.empty[stage], ((j / kRawStages) & 1) ^ 1);
    s.attended[stage] = attended;  // published by the arrive below (release semantics)
    uint64_t* full = &s.full[stage];
    ClusterTransactionBarrier::arrive_and_expect_tx(full, copied * box_rows * kFp8TokenBytes);
    uint8_t* raw = s.stage[stage];
#pragma unroll
    for (int i = 0; i < kMaxBoxes; ++i) {
      if (slots[i] < 0) continue;
      const int row = i * box_rows;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        cute::SM90_TMA_LOAD_3D::copy(&p.fp8_latent_chunk_map, full, kCacheHint,
                                     raw + c * raw_tile::kChunkBytes + row * 128, c * 32, head, slots[i]);
      }
      cute::SM90_TMA_LOAD_3D::copy(&p.kv_tensor_map, full, kCacheHint, raw + raw_tile::kRopeOffset + row * 128,
                                   kRopeColumn, head, slots[i]);
      cute::SM90_TMA_LOAD_3D::copy(&p.fp8_scale_map, full, kCacheHint, raw + raw_tile::scale_offset(row, 0),
                                   kHeadDimV / 4, head, slots[i]);
    }
  }
}

}  // namespace mla
