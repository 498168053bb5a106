// Launches of the low-latency dispatch kernels (bodies in dispatch.cuh).
#include "dispatch.cuh"

using namespace ep_comm::ll;

extern "C" int ep_ll_dispatch_send(const LLDispatchParams* p, void* stream, int num_sms) {
  const int blocks = max(1, min(p->num_tokens, num_sms));
  dispatch_send_kernel<<<blocks, kDispatchSendThreads, 0, static_cast<cudaStream_t>(stream)>>>(*p);
  return cudaGetLastError();
}

extern "C" int ep_ll_dispatch_recv(const LLDispatchParams* p, void* stream) {
  dispatch_recv_kernel<<<p->num_experts, kDispatchRecvThreads, 0, static_cast<cudaStream_t>(stream)>>>(*p);
  return cudaGetLastError();
}
