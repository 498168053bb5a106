// Plain parameter structs shared by the host launchers and the kernels. No torch headers.
#pragma once

#include <cuda.h>
#include <cstdint>

namespace mla {

constexpr int kHeadDim = 576;      // latent (512) + rope (64) per cached token
constexpr int kHeadDimV = 512;     // V is the first 512 columns of K
constexpr int kFp8TokenBytes = 656;  // 512 e4m3 + 4 fp32 scales + 64 bf16 rope
constexpr int kBlockM = 64;        // query rows per CTA
constexpr int kBlockN = 64;        // tokens per KV tile
constexpr int kChunkCols = 64;     // 16-bit columns per 128-byte row of a swizzled chunk
constexpr int kSchedBlock = 64;    // tokens per block of the tile scheduler
constexpr int kMetadataWidth = 5;  // begin_batch, begin_block, end_batch, end_block, begin_split

struct DecodeParams {
  int batch, s_q, h_q, h_kv;
  int heads_per_kv;  // h_q / h_kv
  int rows_per_kv;   // s_q * h_q / h_kv: query rows that share one KV head
  int page_size, max_blocks_per_seq;
  int num_blocks;    // of the cache: block-table entries outside [0, num_blocks) name no block
  int num_parts;
  bool causal;
  float softmax_scale, scale_log2;  // scale_log2 = softmax_scale * log2(e)

  const void* q;              // [b, s_q, h_q, 576] bf16/fp16
  const int* block_table;     // [b, max_blocks_per_seq]
  const int* cache_seqlens;   // [b]
  const int* metadata;        // [num_parts, kMetadataWidth]
  const int* num_splits;      // [b + 1], cumulative pieces per sequence
  void* out;                  // [b, s_q, h_q, 512] bf16/fp16
  float* lse;                 // [b, h_q, s_q]
  float* out_accum;           // [slots, s_q * h_q, 512]: partial results, slots = (b + num_parts) * pieces
  float* lse_accum;           // [slots, s_q * h_q]

  // The cache as the TMA engine sees it: 3-D (column, KV head, slot), boxes of min(page_size, 64)
  // slots. `kv_tensor_map` has 16-bit columns in 128-byte swizzled boxes of 64: all 576 of a
  // 16-bit cache, or the 328 of an FP8 token read as 16-bit (the rope is columns 264-327).
  // The FP8 maps have 32-bit columns in unswizzled boxes: `fp8_latent_map` boxes of 128 (the
  // 512 e4m3 values), `fp8_scale_map` boxes of 4 (the scales, columns 128-131).
  CUtensorMap kv_tensor_map;
  CUtensorMap fp8_latent_map, fp8_scale_map;
  // For the kernel that dequantizes in registers: the e4m3 values in 128-byte swizzled boxes of
  // 32 32-bit columns (a quarter of a token's latent values each).
  CUtensorMap fp8_latent_chunk_map;
};

struct CombineParams {
  int batch, s_q, h_q;
  int slots_per_piece;       // out_accum rows per scheduler piece: 2 for the narrow consumers
  const int* num_splits;     // [b + 1]
  const float* out_accum;    // [b + num_parts, s_q * h_q, 512]
  const float* lse_accum;    // [b + num_parts, s_q * h_q]
  void* out;                 // [b, s_q, h_q, 512]
  float* lse;                // [b, h_q, s_q]
};

// One decode step's tile schedule (scheduler.py); the workspace holds 4 * batch + num_parts + 3
// int64 values.
struct ScheduleParams {
  const int* cache_seqlens;  // [batch]
  int64_t batch;
  int64_t num_parts;
  int* metadata;             // [num_parts, kMetadataWidth]: scheduler.py's columns
  int* splits;               // [batch + 1]
  int64_t* workspace;
};

// Query rows per KV head up to which the decode kernel swaps them into the N dimension of its
// products (consumer_narrow.cuh): 16 with an FP8 cache, else 0 (the 64-row consumers). 32-row
// narrow consumers spill at the FP8 kernel's register split and were no faster (NOTES.md).
// The narrow kernels write two pieces per scheduler piece, always merged by the combine kernel.
inline int narrow_rows(int rows_per_kv, bool is_fp8) { return is_fp8 && rows_per_kv <= 16 ? 16 : 0; }

template <typename T, bool kFp8, int kNarrow>
void run_decode(const DecodeParams& params, cudaStream_t stream);

// Experimental: the narrow FP8 kernel (at most 16 query rows per KV head) that dequantizes in its
// consumers' registers (decode_kernel_fp8_registers.cuh); it writes pieces as run_decode<T, true, 16>.
template <typename T>
void run_decode_fp8_registers(const DecodeParams& params, cudaStream_t stream);

template <typename T>
void run_combine(const CombineParams& params, cudaStream_t stream);

void run_schedule(const ScheduleParams& params, cudaStream_t stream);

}  // namespace mla
