// The barrier every call starts with, and notify: every rank tells every other what it will
// send it (per rank, per channel, per expert), then reads what it will receive. One block each.
#include <c10/cuda/CUDAException.h>

#include "device.cuh"

namespace ep_comm {

__device__ __forceinline__ int* notify_area(uint8_t* buffer, int source) {
  return reinterpret_cast<int*>(buffer + kNotifyOffset) + int64_t(source) * kNotifySlots;
}

__device__ __forceinline__ uint64_t* barrier_flag(uint8_t* buffer, int source) {
  return reinterpret_cast<uint64_t*>(buffer + kFlagsOffset) + source;
}

// All threads of the block call it. What the block wrote before is visible to the peers after.
// Barriers are numbered by a counter in our buffer: every rank runs the same sequence of them.
__device__ bool barrier(const Peers& peers, Step step) {
  __shared__ int all_arrived;
  uint8_t* own = peers.base[peers.rank];
  uint64_t* counter = reinterpret_cast<uint64_t*>(own + kBarrierCounterOffset);
  const uint64_t number = *reinterpret_cast<volatile uint64_t*>(counter) + 1;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) all_arrived = 1;
  __syncthreads();
  if (threadIdx.x < peers.num_ranks) {
    store_release(barrier_flag(peers.base[threadIdx.x], peers.rank), number);
    uint64_t* flag = barrier_flag(own, threadIdx.x);
    if (!wait_until(peers, step, threadIdx.x, 0, [&] { return load_acquire(flag) >= number; })) all_arrived = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) *counter = number;
  __syncthreads();
  return all_arrived;
}

__global__ void barrier_kernel(Peers peers) {
  if (!already_failed(peers)) barrier(peers, kBarrier);
}

__global__ void __launch_bounds__(kThreads, 1) notify_kernel(NotifyParams p) {
  __shared__ int sent[kMaxRanks][kMaxChannels];
  __shared__ int sent_to_rank[kMaxRanks];
  const Peers& peers = p.peers;
  const int num_ranks = peers.num_ranks, num_channels = p.num_channels, rank = peers.rank;
  const int experts_per_rank = p.num_experts / num_ranks;
  uint8_t* own = peers.base[rank];
  if (already_failed(peers)) return;

  for (int i = threadIdx.x; i < num_ranks * num_channels; i += kThreads) {
    const int dst = i / num_channels, channel = i % num_channels;
    const int end = channel_begin(channel + 1, num_channels, p.num_tokens);
    int n = 0;
    for (int t = channel_begin(channel, num_channels, p.num_tokens); t < end; ++t)
      n += p.is_token_in_rank[int64_t(t) * num_ranks + dst];
    sent[dst][channel] = n;
  }
  __syncthreads();
  if (threadIdx.x < num_ranks) {
    int n = 0;
    for (int c = 0; c < num_channels; ++c) n += sent[threadIdx.x][c];
    sent_to_rank[threadIdx.x] = n;
  }
  // Every rank has finished its previous call (and read the counts of its previous notify).
  if (!barrier(peers, kBarrier)) return;

  // Rank dst's area for us: [what we send every rank | per channel, to dst | per expert of dst]
  const int slots = num_ranks + num_channels + experts_per_rank;
  for (int i = threadIdx.x; i < num_ranks * slots; i += kThreads) {
    const int dst = i / slots, k = i % slots;
    int value;
    if (k < num_ranks) value = sent_to_rank[k];
    else if (k < num_ranks + num_channels) value = sent[dst][k - num_ranks];
    else value = p.num_tokens_per_expert[dst * experts_per_rank + k - num_ranks - num_channels];
    notify_area(peers.base[dst], rank)[k] = value;
  }
  if (!barrier(peers, kNotify)) return;

  for (int i = threadIdx.x; i < num_ranks * num_ranks; i += kThreads)
    p.rank_counts[i] = __ldcg(notify_area(own, i / num_ranks) + i % num_ranks);
  for (int i = threadIdx.x; i < num_ranks * num_channels; i += kThreads)
    p.channel_counts[i] = __ldcg(notify_area(own, i / num_channels) + num_ranks + i % num_channels);
  for (int e = threadIdx.x; e < experts_per_rank; e += kThreads) {
    int n = 0;
    for (int source = 0; source < num_ranks; ++source)
      n += __ldcg(notify_area(own, source) + num_ranks + num_channels + e);
    p.expert_counts[e] = n;
  }
}

// One block; without a failure it reads two flags and returns.
__global__ void poison_kernel(PoisonParams p) {
  const int timed_out = *reinterpret_cast<const volatile int*>(p.own + kTimedOutOffset);
  const int overflowed = *reinterpret_cast<const volatile int*>(p.own + kOverflowedOffset);
  if (!timed_out && !overflowed) return;
  if (threadIdx.x == 0) *p.error_flag = timed_out ? 1 : 2;
  for (int o = 0; o < p.num_outputs; ++o) {
    uint32_t* words = reinterpret_cast<uint32_t*>(p.outputs[o].data);
    for (int64_t i = threadIdx.x; i < p.outputs[o].bytes / 4; i += blockDim.x) words[i] = p.outputs[o].pattern;
  }
}

void launch_poison(const PoisonParams& params, cudaStream_t stream) {
  poison_kernel<<<1, kThreads, 0, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_barrier(const Peers& peers, cudaStream_t stream) {
  barrier_kernel<<<1, 32, 0, stream>>>(peers);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_notify(const NotifyParams& params, cudaStream_t stream) {
  notify_kernel<<<1, kThreads, 0, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ep_comm
