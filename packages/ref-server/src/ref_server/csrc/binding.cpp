// Registers the CUDA op; ref_server/model/cutlass_gemm.py calls it.
#include <torch/library.h>

#include "api.h"

TORCH_LIBRARY(ref_server_cuda, m) {
  m.def(
      "fp8_grouped_gemm(Tensor x, Tensor x_scales, Tensor w, Tensor w_scales, Tensor? offsets, "
      "Tensor? counts, int group_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(ref_server_cuda, CUDA, m) {
  m.impl("fp8_grouped_gemm", &ref_server::fp8_grouped_gemm);
}
