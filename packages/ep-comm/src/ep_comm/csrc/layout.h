// The cuda backend's buffer layout and the kernels' parameters.
//
// Every rank owns one CUDA IPC buffer and maps its peers'. Rank r's buffer holds:
//   control: r's barrier counter, one barrier flag per peer, the counts peers send r (notify),
//     and a head and a tail counter per (channel, peer);
//   rings: per (channel c, peer s), ring_tokens slots that s fills with the tokens it sends r
//     through channel c, and r drains.
// Every call starts with a barrier across ranks, so all ranks have finished the previous call:
// each call may lay the rings out anew (channels, token width, ring size). Head and tail
// counters only grow, across calls: slot = counter % ring_tokens; the sender owns the tail
// (rows written), the receiver the head (rows read). Flags, counters and rings are read and
// written with system-scope ordering: peers are other processes, on this GPU or another one of
// the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ep_comm {

constexpr int kMaxRanks = 8;
constexpr int kMaxChannels = 64;
constexpr int kNotifySlots = 1024;  // int32 per source: rank counts, channel counts, expert counts
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

constexpr int64_t kBarrierCounterOffset = 0;
constexpr int64_t kTimedOutOffset = 64;   // int, set once a wait timed out
constexpr int64_t kOverflowedOffset = 68;  // int, set once a dispatch dropped rows
constexpr int64_t kFlagsOffset = 128;
constexpr int64_t kNotifyOffset = 1024;
constexpr int64_t kCountersOffset = kNotifyOffset + int64_t(kMaxRanks) * kNotifySlots * 4;
constexpr int64_t kControlBytes = kCountersOffset + int64_t(kMaxChannels) * kMaxRanks * 16;

enum Step : int {
  kBarrier = 1,
  kNotify = 2,
  kDispatchSend = 3,
  kDispatchReceive = 4,
  kCombineSend = 5,
  kCombineReceive = 6
};

// Host-mapped status of a buffer, for the host's messages. A timeout is final (counters are left
// mid-call): [0] its Step, [1] the peer waited for, [2] the channel. An overflow (more rows than
// the outputs hold; the extra rows are dropped, the call completes): [4] the most rows that
// arrived. Either also sets its flag in the buffer (device memory), which the poison kernel
// after every call reads: from then on every call's outputs are NaN, until the buffer is rebuilt.
constexpr int kStatusInts = 8;
constexpr int kStatusReceivedRows = 4;

struct Peers {
  uint8_t* base[kMaxRanks];  // every rank's buffer, mapped in this process (ours at [rank])
  int rank;
  int num_ranks;
  uint64_t timeout_ns;
  int* status;  // host-mapped, kStatusInts
};

// One piece of a token row: `bytes` per row (a multiple of 4) at `offset` in the ring slot.
struct Field {
  const uint8_t* src;  // row i at src + i * bytes
  uint8_t* dst;        // row i at dst + i * bytes (dispatch receivers)
  int64_t bytes;
  int64_t offset;
};

constexpr int kMaxFields = 4;

struct Rings {
  int num_channels;
  int ring_tokens;
  int send_chunk;  // rows a sender writes before publishing them
  int64_t slot_bytes;
};

struct NotifyParams {
  Peers peers;
  const bool* is_token_in_rank;      // [num_tokens, num_ranks]
  const int* num_tokens_per_expert;  // [num_experts]
  int num_tokens;
  int num_experts;
  int num_channels;
  int* rank_counts;     // out [num_ranks, num_ranks]: tokens rank i sends rank j
  int* channel_counts;  // out [num_ranks, num_channels]: tokens we receive from rank i via channel c
  int* expert_counts;   // out [num_experts / num_ranks]: received tokens per local expert
};

struct DispatchParams {
  Peers peers;
  Rings rings;
  Field fields[kMaxFields];  // token rows: x, FP8 scales, top-k ids, top-k weights
  int num_fields;
  int64_t index_offset;  // int32 source token index in the slot
  const bool* is_token_in_rank;  // [num_tokens, num_ranks]
  const int* channel_counts;     // [num_ranks, num_channels] (from notify or a handle)
  int num_tokens;
  int32_t* recv_src_idx;  // out [capacity]
  int64_t capacity;       // rows of the outputs
};

struct CombineParams {
  Peers peers;
  Rings rings;
  const bool* is_token_in_rank;  // [num_tokens, num_ranks] of the dispatch
  const int* channel_counts;     // [num_ranks, num_channels] of the dispatch
  int num_tokens;
  int hidden;
  int num_topk;                         // 0 without weights
  const uint8_t* x;                     // [x_rows, hidden] bf16
  int64_t x_rows;                       // rows of x: more arrived only after an overflow
  const uint8_t* topk_weights;          // [received rows, num_topk] fp32
  const uint8_t* bias[2];               // [num_tokens, hidden] bf16 or null
  uint8_t* combined_x;                  // out [num_tokens, hidden] bf16
  float* combined_topk_weights;         // out [num_tokens, num_topk]
  int64_t weights_offset;               // in the slot
};

// An output the poison kernel overwrites after a failure: `bytes` (a multiple of 4) at `data`,
// every 4 bytes set to `pattern` (NaN for floating point, -1 for indices).
struct Poisoned {
  uint8_t* data;
  int64_t bytes;
  uint32_t pattern;
};

constexpr int kMaxPoisoned = 8;

struct PoisonParams {
  const uint8_t* own;  // this rank's buffer: its timed-out and overflowed flags
  Poisoned outputs[kMaxPoisoned];
  int num_outputs;
  int* error_flag;  // out [1]: 1 after a timeout, 2 after an overflow (kept once set)
};

void launch_barrier(const Peers& peers, cudaStream_t stream);
void launch_poison(const PoisonParams& params, cudaStream_t stream);
void launch_notify(const NotifyParams& params, cudaStream_t stream);
void launch_dispatch(const DispatchParams& params, cudaStream_t stream);
void launch_combine(const CombineParams& params, cudaStream_t stream);

}  // namespace ep_comm
