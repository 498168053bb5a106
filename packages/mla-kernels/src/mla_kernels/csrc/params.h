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
constexpr int kSchedBlock = 64;    // tokens per block of the tile scheduler
constexpr int kMetadataWidth = 5;  // begin_batch, begin_block, end_batch, end_block, begin_split

struct DecodeParams {
  int batch, s_q, h_q, h_kv;
  int heads_per_kv;  // h_q / h_kv
  int rows_per_kv;   // s_q * h_q / h_kv: query rows that share one KV head
  int page_size, max_blocks_per_seq;
  int num_parts;
  bool causal;
  float softmax_scale, scale_log2;  // scale_log2 = softmax_scale * log2(e)

  const void* q;              // [b, s_q, h_q, 576] bf16/fp16
  const uint8_t* k_cache;     // FP8 layout: [num_blocks, page_size, h_kv, 656] (read without TMA)
  const int* block_table;     // [b, max_blocks_per_seq]
  const int* cache_seqlens;   // [b]
  const int* metadata;        // [num_parts, kMetadataWidth]
  const int* num_splits;      // [b + 1], cumulative pieces per sequence
  void* out;                  // [b, s_q, h_q, 512] bf16/fp16
  float* lse;                 // [b, h_q, s_q]
  float* out_accum;           // [b + num_parts, s_q * h_q, 512]: partial results of split sequences
  float* lse_accum;           // [b + num_parts, s_q * h_q]

  // A 16-bit cache as a 3-D tensor (columns, KV head, slot) in 128-byte swizzled boxes of 64
  // columns and min(page_size, 64) slots.
  CUtensorMap kv_tensor_map;
};

struct CombineParams {
  int batch, s_q, h_q;
  const int* num_splits;     // [b + 1]
  const float* out_accum;    // [b + num_parts, s_q * h_q, 512]
  const float* lse_accum;    // [b + num_parts, s_q * h_q]
  void* out;                 // [b, s_q, h_q, 512]
  float* lse;                // [b, h_q, s_q]
};

template <typename T, bool kFp8>
void run_decode(const DecodeParams& params, cudaStream_t stream);

template <typename T>
void run_combine(const CombineParams& params, cudaStream_t stream);

}  // namespace mla
