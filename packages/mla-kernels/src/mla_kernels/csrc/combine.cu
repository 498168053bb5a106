#include "combine_kernel.cuh"

template void mla::run_combine<__nv_bfloat16>(const mla::CombineParams&, cudaStream_t);
template void mla::run_combine<__half>(const mla::CombineParams&, cudaStream_t);
