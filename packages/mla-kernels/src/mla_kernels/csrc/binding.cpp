// Registers the CUDA ops; mla_kernels/decode.py and mla_kernels/scheduler.py call them.
#include <torch/library.h>

#include "api.h"

TORCH_LIBRARY(mla_kernels_cuda, m) {
  m.def(
      "mla_decode(Tensor q, Tensor k_cache, Tensor block_table, Tensor cache_seqlens, "
      "Tensor tile_scheduler_metadata, Tensor num_splits, float softmax_scale, bool causal, "
      "bool is_fp8_kvcache, bool fp8_in_registers) -> (Tensor, Tensor)");
  m.def("mla_schedule(Tensor cache_seqlens, int num_parts) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mla_kernels_cuda, CUDA, m) {
  m.impl("mla_decode", &mla::mla_decode);
  m.impl("mla_schedule", &mla::mla_schedule);
}
