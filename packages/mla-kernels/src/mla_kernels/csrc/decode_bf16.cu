// One instantiation per file keeps each nvcc job small and parallel.
#include "decode_kernel.cuh"

template void mla::run_decode<__nv_bfloat16, false, 0>(const mla::DecodeParams&, cudaStream_t);
