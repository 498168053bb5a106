// Launches of the low-latency combine kernels (bodies in combine.cuh).
#include "combine.cuh"

using namespace ep_comm::ll;

extern "C" int ep_ll_combine_send(const LLCombineParams* p, void* stream) {
  combine_send_kernel<<<p->num_experts, kCombineSendThreads, 0, static_cast<cudaStream_t>(stream)>>>(*p);
  return cudaGetLastError();
}

extern "C" int ep_ll_combine_recv(const LLCombineParams* p, void* stream) {
  const int blocks = max(1, p->num_tokens);
  combine_recv_kernel<<<blocks, kCombineRecvThreads, 0, static_cast<cudaStream_t>(stream)>>>(*p);
  return cudaGetLastError();
}
