// Low-latency mode over NVSHMEM: the kernels' parameters and the C ABI that nvshmem.py loads.
//
// Plain C types only: cuda_low_latency.py mirrors these structs with ctypes, field by field.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Steps recorded in the status words (cuda_low_latency.STEPS names them).
enum LLStep { kDispatchSend = 1, kDispatchRecv = 2, kCombineSend = 3, kCombineRecv = 4 };

// Host-mapped status: the first failure of this buffer's kernels.
enum LLStatus { kStatusStep = 0, kStatusPeer = 1, kStatusExpert = 2, kStatusFailedRank = 3, kStatusInts = 8 };

// Blocks-finished counters, one per kernel kind and slot.
enum LLKernel { kKernelDispatchSend = 0, kKernelDispatchRecv = 1, kKernelCombineSend = 2, kKernelCombineRecv = 3 };

// One slot of the buffer (calls alternate between two) plus the buffer-wide words.
typedef struct {
  int32_t rank;
  int32_t num_ranks;
  uint64_t timeout_ns;
  uint8_t* send;              // this slot's send area: symmetric, only this rank writes it
  uint8_t* recv;              // this slot's receive area: symmetric, peers put into it
  uint64_t* dispatch_counts;  // [num_experts] symmetric: local expert le from rank s at le * R + s
  uint64_t* combine_flags;    // [num_experts] symmetric: one per global expert
  uint64_t* acks;             // [R] symmetric: the last use of this slot rank s finished reading
  uint64_t* failed;           // symmetric word of the buffer: 0, or 1 + a rank that timed out
  uint32_t* use;              // this slot's use counter (device memory)
  uint32_t* done;             // [4] this slot's blocks-finished counters (LLKernel)
  uint32_t* recorded;         // buffer-wide device word: the status holds a failure
  int32_t* error_flag;        // [1] set once outputs were poisoned
  int32_t* status;            // [kStatusInts] host-mapped
} LLSlot;

// Both dispatch kernels. T = max_tokens, E = num_experts, E_local = E / R.
typedef struct {
  LLSlot slot;
  const uint16_t* x;            // [num_tokens, hidden] bf16
  const int64_t* topk_idx;      // [num_tokens, num_topk], -1 = none
  int32_t* expert_counters;     // [E] zero between calls (the send kernel resets it)
  int32_t num_tokens;
  int32_t num_topk;
  int32_t hidden;
  int32_t max_tokens;
  int32_t num_experts;
  int32_t use_fp8;
  int32_t round_scale;
  int32_t use_ue8m0;
  int64_t message_bytes;        // stride of messages in the send and receive areas
  void* recv_x;                 // [E_local, R*T, hidden] e4m3 or bf16
  void* recv_scales;            // fp32 [E_local, hidden/128, R*T] or ue8m0 int32 [E_local, hidden/512, R*T]
  int32_t* recv_count;          // [E_local] zeroed by the caller
  int32_t* recv_src_info;       // [E_local, R*T]
  int64_t* recv_layout_range;   // [E_local, R]
  int32_t* cumulative_stats;    // [E_local] or null
  int64_t* wait_cost_stats;     // [R] or null
} LLDispatchParams;

// Both combine kernels.
typedef struct {
  LLSlot slot;
  const uint16_t* x;            // [E_local, R*T, hidden] bf16: the experts' outputs
  const int32_t* src_info;      // [E_local, R*T]
  const int64_t* layout_range;  // [E_local, R]
  const int64_t* topk_idx;      // [num_tokens, num_topk] this rank's routing
  const float* topk_weights;    // [num_tokens, num_topk]
  uint16_t* out;                // [num_tokens, hidden] bf16
  int32_t num_tokens;
  int32_t num_topk;
  int32_t hidden;
  int32_t max_tokens;
  int32_t num_experts;
  int32_t zero_copy;            // x already is the send area
  int64_t* wait_cost_stats;     // [R] or null
} LLCombineParams;

// Bootstrap and memory (host.cu). Nonzero return values are NVSHMEM or CUDA error codes.
int ep_ll_unique_id_bytes(void);
int ep_ll_get_unique_id(void* out);
int ep_ll_init(int rank, int num_ranks, const void* unique_id);
int ep_ll_my_pe(void);
int ep_ll_num_pes(void);
int ep_ll_init_status(void);
void* ep_ll_malloc(uint64_t bytes);  // collective, zeroed; null on failure
void ep_ll_free(void* ptr);          // collective
void ep_ll_barrier_all(void);
int ep_ll_quiet(void);  // completes this PE's kernels' puts and signals; a cudaError_t

// Launches on `stream` (a cudaStream_t); they return the launch's cudaError_t.
int ep_ll_dispatch_send(const LLDispatchParams* p, void* stream, int num_sms);
int ep_ll_dispatch_recv(const LLDispatchParams* p, void* stream);
int ep_ll_combine_send(const LLCombineParams* p, void* stream);
int ep_ll_combine_recv(const LLCombineParams* p, void* stream);

#ifdef __cplusplus
}
#endif
