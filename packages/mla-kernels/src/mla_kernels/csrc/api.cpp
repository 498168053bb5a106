// The torch-facing half of the CUDA op: allocations, parameters, the TMA descriptor, launches.
#include "api.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>

#include "params.h"

namespace mla {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const auto encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult status;
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                                    cudaEnableDefault, &status));
    TORCH_CHECK(status == cudaDriverEntryPointSuccess && function != nullptr,
                "the CUDA driver does not provide cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encoder;
}

// The cache as (column, KV head, slot) with `column_bytes`-wide columns, in boxes of
// `box_columns` x 1 x min(page_size, 64); see DecodeParams.
CUtensorMap cache_tensor_map(const at::Tensor& k_cache, int column_bytes, int box_columns,
                             CUtensorMapSwizzle swizzle) {
  const cuuint64_t slots = k_cache.size(0) * k_cache.size(1), h_kv = k_cache.size(2);
  const cuuint64_t row_bytes = k_cache.size(3) * k_cache.element_size();
  const cuuint64_t dims[3] = {row_bytes / column_bytes, h_kv, slots};
  const cuuint64_t strides[2] = {row_bytes, h_kv * row_bytes};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_columns), 1,
                             static_cast<cuuint32_t>(std::min<int64_t>(k_cache.size(1), kBlockN))};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult result = tensor_map_encoder()(
      &map, column_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_UINT32, 3,
      k_cache.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(result),
              ") for a k_cache of shape ", k_cache.sizes());
  return map;
}

template <typename T>
void launch(const DecodeParams& params, const CombineParams& combine, bool is_fp8, bool fp8_in_registers,
            cudaStream_t stream) {
  switch (narrow_rows(params.rows_per_kv, is_fp8)) {
    case 16:
      fp8_in_registers ? run_decode_fp8_registers<T>(params, stream) : run_decode<T, true, 16>(params, stream);
      break;
    default: is_fp8 ? run_decode<T, true, 0>(params, stream) : run_decode<T, false, 0>(params, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  run_combine<T>(combine, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> mla_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                              const at::Tensor& block_table, const at::Tensor& cache_seqlens,
                                              const at::Tensor& tile_scheduler_metadata,
                                              const at::Tensor& num_splits, double softmax_scale, bool causal,
                                              bool is_fp8_kvcache, bool fp8_in_registers) {
  for (const at::Tensor* t : {&q, &k_cache, &block_table, &cache_seqlens, &tile_scheduler_metadata, &num_splits}) {
    TORCH_CHECK(t->is_cuda() && t->device() == q.device(), "all mla_decode inputs must be on ", q.device());
    TORCH_CHECK(t->is_contiguous(), "mla_decode inputs must be contiguous");
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(k_cache.data_ptr()) % 16 == 0, "k_cache must be 16-byte aligned");
  const c10::cuda::CUDAGuard guard(q.device());

  const int batch = q.size(0), s_q = q.size(1), h_q = q.size(2);
  const int page_size = k_cache.size(1), h_kv = k_cache.size(2);
  const int num_parts = tile_scheduler_metadata.size(0);
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor out = at::empty({batch, s_q, h_q, kHeadDimV}, q.options());
  at::Tensor lse = at::empty({batch, h_q, s_q}, f32);
  // A sequence is cut at most once per partition boundary, so b + num_parts pieces suffice.
  const int slots_per_piece = narrow_rows(s_q * (h_q / h_kv), is_fp8_kvcache) ? 2 : 1;
  const int slots = (batch + num_parts) * slots_per_piece;
  at::Tensor out_accum = at::empty({slots, s_q * h_q, kHeadDimV}, f32);
  at::Tensor lse_accum = at::empty({slots, s_q * h_q}, f32);

  DecodeParams params{};
  params.batch = batch;
  params.s_q = s_q;
  params.h_q = h_q;
  params.h_kv = h_kv;
  params.heads_per_kv = h_q / h_kv;
  params.rows_per_kv = s_q * (h_q / h_kv);
  params.page_size = page_size;
  params.max_blocks_per_seq = block_table.size(1);
  params.num_blocks = k_cache.size(0);
  params.num_parts = num_parts;
  params.causal = causal;
  params.softmax_scale = static_cast<float>(softmax_scale);
  params.scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  params.q = q.data_ptr();
  params.block_table = block_table.data_ptr<int>();
  params.cache_seqlens = cache_seqlens.data_ptr<int>();
  params.metadata = tile_scheduler_metadata.data_ptr<int>();
  params.num_splits = num_splits.data_ptr<int>();
  params.out = out.data_ptr();
  params.lse = lse.data_ptr<float>();
  params.out_accum = out_accum.data_ptr<float>();
  params.lse_accum = lse_accum.data_ptr<float>();
  params.kv_tensor_map = cache_tensor_map(k_cache, 2, kChunkCols, CU_TENSOR_MAP_SWIZZLE_128B);
  if (is_fp8_kvcache) {
    params.fp8_latent_map = cache_tensor_map(k_cache, 4, kHeadDimV / 4, CU_TENSOR_MAP_SWIZZLE_NONE);
    params.fp8_scale_map = cache_tensor_map(k_cache, 4, kHeadDimV / 128, CU_TENSOR_MAP_SWIZZLE_NONE);
    if (fp8_in_registers) {
      params.fp8_latent_chunk_map = cache_tensor_map(k_cache, 4, 128 / 4, CU_TENSOR_MAP_SWIZZLE_128B);
    }
  }

  CombineParams combine{batch,          s_q,        h_q, slots_per_piece, params.num_splits, params.out_accum,
                        params.lse_accum, params.out, params.lse};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (q.scalar_type() == at::kBFloat16) {
    launch<__nv_bfloat16>(params, combine, is_fp8_kvcache, fp8_in_registers, stream);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kHalf, "q must be bfloat16 or float16");
    launch<__half>(params, combine, is_fp8_kvcache, fp8_in_registers, stream);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> mla_schedule(const at::Tensor& cache_seqlens, int64_t num_parts) {
  TORCH_CHECK(cache_seqlens.is_cuda() && cache_seqlens.scalar_type() == at::kInt && cache_seqlens.dim() == 1 &&
                  cache_seqlens.numel() > 0 && cache_seqlens.is_contiguous(),
              "cache_seqlens must be a non-empty contiguous 1-D int32 CUDA tensor");
  TORCH_CHECK(num_parts >= 1, "num_parts must be >= 1, got ", num_parts);
  const c10::cuda::CUDAGuard guard(cache_seqlens.device());
  const int64_t batch = cache_seqlens.size(0);
  const auto options = cache_seqlens.options();
  at::Tensor metadata = at::empty({num_parts, kMetadataWidth}, options);
  at::Tensor splits = at::empty({batch + 1}, options);
  at::Tensor workspace = at::empty({4 * batch + num_parts + 3}, options.dtype(at::kLong));
  const ScheduleParams params{cache_seqlens.data_ptr<int>(), batch,
                              num_parts,                     metadata.data_ptr<int>(),
                              splits.data_ptr<int>(),        workspace.data_ptr<int64_t>()};
  run_schedule(params, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {metadata, splits};
}

}  // namespace mla
