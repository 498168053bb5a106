#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace mla {

// The CUDA implementation of torch.ops.mla_kernels.mla_decode; see mla_kernels/decode.py for
// the arguments (validated there). `fp8_in_registers` selects the experimental narrow FP8 kernel
// (mla_kernels.extension.fp8_in_registers).
std::tuple<at::Tensor, at::Tensor> mla_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                              const at::Tensor& block_table, const at::Tensor& cache_seqlens,
                                              const at::Tensor& tile_scheduler_metadata,
                                              const at::Tensor& num_splits, double softmax_scale, bool causal,
                                              bool is_fp8_kvcache, bool fp8_in_registers);

// The CUDA implementation of mla_kernels.scheduler.schedule (see there).
std::tuple<at::Tensor, at::Tensor> mla_schedule(const at::Tensor& cache_seqlens, int64_t num_parts);

}  // namespace mla
