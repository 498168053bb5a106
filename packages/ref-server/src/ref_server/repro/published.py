"""The published figures the projection uses or compares with, each citing its source.

Every value is copied from the public document its term names (DeepSeek's open-infra-index
day 6 post and profile-data, DeepEP's README, SGLang's large-scale EP post, NVIDIA's spec
sheets); none is computed here. The day-6 figures
that `ref_server.economics` holds already (its "deepseek-day6" preset) are read from there.
"Per node" means per 8-GPU node of the phase that produced the tokens unless the note says
otherwise.
"""

from __future__ import annotations

from ref_server.economics import PRESETS
from ref_server.repro.terms import Term

_DAY6 = PRESETS["deepseek-day6"]

DAY6 = "DeepSeek open-infra-index, day 6 post: 24 h from 2025-02-27 12:00 UTC+8"
PROFILE = "deepseek-ai/profile-data@4496024 settings"
SGLANG = "LMSYS blog 2025-05-05, SGLang large-scale EP on 96 x H100"
DEEPEP_LL = "DeepEP README@567632d, H800 + CX7 IB, 128 tokens, H 7168, top-8"
DEEPEP_NORMAL = "DeepEP README, H800 + CX7 IB, 4096 tokens, H 7168, top-8"
V3_REPORT = "DeepSeek-V3 technical report, arXiv 2412.19437, section 5.4.3"


def _term(name: str, value: float, unit: str, note: str) -> Term:
    return Term(name, value, unit, "published", note)


GPUS_PER_NODE = _term("gpus_per_node", _DAY6.gpus_per_node, "GPU", f"H800 nodes of 8 GPUs; {DAY6}")
GPU_HOUR_USD = _term(
    "gpu_hour_usd",
    _DAY6.gpu_hour_usd,
    "USD/GPU-hour",
    f"DeepSeek's assumed H800 rental price; {DAY6}",
)
CACHE_HIT_SHARE = _term(
    "cache_hit_share", 0.563, "1", f"342 B of 608 B input tokens hit the on-disk KV cache; {DAY6}"
)

# DeepSeek's production day: averages over 24 h of varying load, not saturation figures.
DAY6_PREFILL_PER_NODE = _term(
    "day6_prefill_per_node",
    _DAY6.prefill_tokens_per_s_per_node,
    "tok/s/node",
    f"input tokens incl. cache hits; {DAY6}",
)
DAY6_DECODE_PER_NODE = _term(
    "day6_decode_per_node", _DAY6.decode_tokens_per_s_per_node, "tok/s/node", f"output; {DAY6}"
)
DAY6_MEAN_KV_LENGTH = _term(
    "day6_mean_kv_length", 4_989, "tok", f"mean KV length per output token; {DAY6}"
)

# DeepSeek-V3's MTP module: one draft token a round.
MTP_ACCEPTANCE = _term(
    "mtp_acceptance",
    0.85,
    "1",
    f"the second token's acceptance rate, 85-90 % across generation topics: its lower end; "
    f"{V3_REPORT}",
)
MTP_DRAFTS = _term(
    "mtp_drafts", 1, "tok", f"one MTP module, predicting one more token; {V3_REPORT}"
)
MTP_DECODE_SPEEDUP = _term(
    "mtp_decode_speedup", 1.8, "1", f"decoding speed (TPS) with MTP over without; {V3_REPORT}"
)

# The operating points of profile-data (simulated with perfectly balanced routing).
PROFILE_PREFILL_TOKENS_PER_GPU = _term(
    "profile_prefill_tokens_per_gpu", 16_384, "tok", f"EP32, 4K prompts; {PROFILE}"
)
PROFILE_PREFILL_MICROBATCHES = _term(
    "profile_prefill_microbatches", 2, "microbatch", f"two microbatches of 8,192; {PROFILE}"
)
PROFILE_DECODE_REQUESTS_PER_GPU = _term(
    "profile_decode_requests_per_gpu", 128, "request", f"EP128, 4K prompts; {PROFILE}"
)
PROFILE_PREFILL_PER_NODE = _term(
    "profile_prefill_per_node",
    62_713,
    "tok/s/node",
    "SGLang's 'DeepSeek profile' figure derived from profile-data, 16 nodes, KV 4096; how it "
    f"was derived is not stated; {SGLANG}",
)
PROFILE_DECODE_PER_NODE = _term(
    "profile_decode_per_node",
    18_598,
    "tok/s/node",
    "SGLang's 'DeepSeek profile' figure; SGLang's simulated-MTP comparison implies it includes "
    f"MTP; {SGLANG}",
)

# SGLang's open reproduction: saturation figures (decode through the "slow-down" API).
SGLANG_PREFILL_PER_NODE = {
    1_000: _term("sglang_prefill_1k_per_node", 57_674, "tok/s/node", f"EP32, 1K input; {SGLANG}"),
    2_000: _term("sglang_prefill_2k_per_node", 54_543, "tok/s/node", f"EP32, 2K input; {SGLANG}"),
    4_000: _term("sglang_prefill_4k_per_node", 50_302, "tok/s/node", f"EP32, 4K input; {SGLANG}"),
}
SGLANG_DECODE_PER_NODE = _term(
    "sglang_decode_per_node", 22_282, "tok/s/node", f"EP72, 2K input, 256 req/GPU; {SGLANG}"
)
SGLANG_DECODE_MTP_PER_NODE = _term(
    "sglang_decode_simulated_mtp_per_node",
    17_373,
    "tok/s/node",
    f"EP72, simulated MTP, KV 4K, 128 req/GPU; {SGLANG}",
)
SGLANG_PREFILL_BALANCEDNESS = _term(
    "sglang_prefill_balancedness",
    0.85,
    "1",
    f"SGLang's prefill with its default expert placement vs simulated perfect balance; {SGLANG}",
)

# DeepEP's communication figures on H800 + InfiniBand ("published-H800-IB").
DEEPEP_LL_DISPATCH_EP8_NVLINK = _term(
    "deepep_ll_dispatch_ep8_nvlink", 77e-6, "s", f"EP8 over NVLink, FP8, PR #173; {DEEPEP_LL}"
)
DEEPEP_LL_COMBINE_EP8_NVLINK = _term(
    "deepep_ll_combine_ep8_nvlink", 114e-6, "s", f"EP8 over NVLink, BF16, PR #173; {DEEPEP_LL}"
)
DEEPEP_LL_DISPATCH_EP128 = _term(
    "deepep_ll_dispatch_ep128", 192e-6, "s", f"EP128 over IB, FP8; {DEEPEP_LL}"
)
DEEPEP_LL_COMBINE_EP128 = _term(
    "deepep_ll_combine_ep128", 369e-6, "s", f"EP128 over IB, BF16; {DEEPEP_LL}"
)
DEEPEP_LL_TOKENS = _term(
    "deepep_ll_tokens", 128, "tok", f"tokens per rank of those figures; {DEEPEP_LL}"
)
DEEPEP_NORMAL_DISPATCH_EP32 = _term(
    "deepep_normal_dispatch_ep32",
    58e9,
    "B/s",
    f"internode EP32 RDMA bandwidth, FP8, after the April 2025 update; {DEEPEP_NORMAL}",
)
DEEPEP_NORMAL_COMBINE_EP32 = _term(
    "deepep_normal_combine_ep32",
    57e9,
    "B/s",
    f"internode EP32 RDMA bandwidth, BF16, after the April 2025 update; {DEEPEP_NORMAL}",
)

# Hardware: NVIDIA's spec sheets; NVLink as DeepEP measured it.
H800_HBM_BANDWIDTH = _term("h800_hbm_bandwidth", 3.35e12, "B/s", "NVIDIA H800 SXM spec")
H200_HBM_BANDWIDTH = _term("h200_hbm_bandwidth", 4.8e12, "B/s", "NVIDIA H200 SXM spec")
H800_HBM_CAPACITY = _term("h800_hbm_capacity", 80e9, "B", "NVIDIA H800 SXM spec, 80 GB")
H200_HBM_CAPACITY = _term("h200_hbm_capacity", 141e9, "B", "NVIDIA H200 SXM spec, 141 GB")
DENSE_BF16_TENSOR = _term(
    "dense_bf16_tensor_flops",
    990e12,
    "FLOP/s",
    "NVIDIA spec: H800, H100 and H200 alike, the same SM count",
)
H800_NVLINK = _term(
    "h800_nvlink_per_direction", 160e9, "B/s", "usable per direction on H800, DeepEP README"
)
CX7_RDMA = _term(
    "cx7_rdma_per_gpu",
    50e9,
    "B/s",
    "one 400 Gb/s ConnectX-7 InfiniBand card per H800, ~50 GB/s at most; DeepEP README",
)
