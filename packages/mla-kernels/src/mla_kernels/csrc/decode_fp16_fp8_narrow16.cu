// One instantiation per file keeps each nvcc job small and parallel.
#include "decode_kernel.cuh"

template void mla::run_decode<__half, true, 16>(const mla::DecodeParams&, cudaStream_t);
