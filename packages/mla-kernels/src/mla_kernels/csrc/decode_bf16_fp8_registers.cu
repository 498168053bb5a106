// One instantiation per file keeps each nvcc job small and parallel.
#include "decode_kernel_fp8_registers.cuh"

template void mla::run_decode_fp8_registers<__nv_bfloat16>(const mla::DecodeParams&, cudaStream_t);
