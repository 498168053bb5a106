"""DeepSeek's libraries where the model calls ours: DeepGEMM for the FP8 GEMMs (`DeepGemm`) and
DeepEP for the expert exchange (`deep_ep_buffer`). FlashMLA needs no adapter: it has the call
surface mla_kernels copies (`attention.DecodeAttention`). Each takes the imported library, so
this module imports none of them (`ref_server.model.kernel_set` does, when a model asks).

Coded against DeepGEMM 2.6.1 (54e2261) and DeepEP 2.1.0 (dd758ca) on sm90, where DeepGEMM takes
fp32 scales and writes bf16; see docs/model.md ("Kernels: ours or DeepSeek's").
"""

from __future__ import annotations

import torch

from ref_server.kernels.fp8_gemm import check_inputs


class DeepGemm:
    """`fp8_gemm.block_gemm`'s arguments and result, through DeepGEMM (x e4m3 with fp32 scales
    per token and 128 channels, w e4m3 with fp32 scales per 128 x 128 block, as DeepGEMM's
    "legacy" sm90 recipe takes them; it lays the activations' scales out for its TMA itself):

    - dense, x `[..., m, k]` @ w `[n, k]`^T: `fp8_gemm_nt` on x as `[m, k]`;
    - grouped, x `[m, k]` with rows grouped by expert, group g ending at offsets[g]:
      `m_grouped_fp8_gemm_nt_contiguous` in its psum layout, where each group's rows start at a
      multiple of its alignment (`get_mk_alignment_for_contiguous_layout`) and end where
      `grouped_layout[g]` says. The rows are copied into that padded layout and the results
      back; the padded tensors are sized for the worst case (m + e (alignment - 1) rows: no
      size may depend on device values), of which the kernel visits the groups' blocks alone;
    - batched, x `[e, rows, k]` with counts `[e]`: `m_grouped_fp8_gemm_nt_masked`, masked_m the
      counts (every row without), expected_m the rows of a block.

    Out in bf16, the only output DeepGEMM's sm90 FP8 kernels write."""

    def __init__(self, deep_gemm) -> None:
        self.library = deep_gemm

    def __call__(
        self, x, x_scales, w, w_scales, offsets=None, out_dtype=torch.bfloat16, counts=None
    ) -> torch.Tensor:
        layout = check_inputs(x, x_scales, w, w_scales, offsets, counts, out_dtype)
        if out_dtype != torch.bfloat16:
            raise ValueError(f"DeepGEMM's FP8 GEMMs write torch.bfloat16, not {out_dtype}")
        if layout.kind == "dense":
            rows = x.reshape(-1, layout.k)
            out = x.new_empty(rows.shape[0], layout.n, dtype=torch.bfloat16)
            scales = x_scales.reshape(rows.shape[0], -1)
            self.library.fp8_gemm_nt((rows, scales), (w, w_scales), out)
            return out.view(layout.out_shape)
        if layout.kind == "grouped":
            return self._contiguous(x, x_scales, w, w_scales, offsets)
        e, rows = x.shape[:2]
        out = x.new_empty(e, rows, layout.n, dtype=torch.bfloat16)
        if rows == 0:  # DeepGEMM asserts rows > 0
            return out
        if counts is None:
            counts = torch.full((e,), rows, dtype=torch.int32, device=x.device)
        self.library.m_grouped_fp8_gemm_nt_masked(
            (x, x_scales), (w, w_scales), out, counts, expected_m=rows
        )
        return out

    def _contiguous(self, x, x_scales, w, w_scales, offsets) -> torch.Tensor:
        m, e, n = x.shape[0], w.shape[0], w.shape[1]
        align = self.library.get_mk_alignment_for_contiguous_layout()
        ends = offsets.long()
        counts = ends.diff(prepend=ends.new_zeros(1))
        spans = (counts + align - 1) // align * align
        starts = spans.cumsum(0) - spans  # each group's first row in the padded layout
        capacity = m + e * (align - 1)
        row = torch.arange(m, device=x.device)
        group = torch.searchsorted(ends, row, right=True)  # e: past the groups (another rank's)
        mine = group.clamp(max=e - 1)
        at = starts[mine] + row - (ends[mine] - counts[mine])
        at = torch.where(group < e, at, capacity)  # those to a spare row the kernel never reads
        padded = x.new_empty(capacity + 1, x.shape[1])
        padded_scales = x_scales.new_empty(capacity + 1, x_scales.shape[1])
        padded[at] = x
        padded_scales[at] = x_scales
        out = x.new_empty(capacity, n, dtype=torch.bfloat16)
        self.library.m_grouped_fp8_gemm_nt_contiguous(
            (padded[:capacity], padded_scales[:capacity]),
            (w, w_scales),
            out,
            (starts + counts).int(),
            use_psum_layout=True,
            expected_m_for_psum_layout=max(-(-m // e), 1),
        )
        return out[at.clamp(max=capacity - 1)]


def deep_ep_buffer(deep_ep, group, hidden: int, num_experts: int, low_latency_tokens: int):
    """DeepEP V1's `deep_ep.Buffer` where `ExpertParallel` builds ep_comm's (the same calls),
    sized as it sizes that: the normal mode's intranode buffer for bf16 rows of `hidden` (the
    larger of DeepEP's dispatch and combine configs' hints) and, with low_latency_tokens (T),
    the low-latency mode's buffer with a queue pair per local expert, as that mode requires.
    explicitly_destroy: `ExpertParallel` frees a buffer before it builds the next."""
    buffer, ranks = deep_ep.Buffer, group.size()
    try:
        configs = (buffer.get_dispatch_config(ranks), buffer.get_combine_config(ranks))
    except AssertionError as error:  # DeepEP knows configs for some rank counts only
        raise ValueError(f"DeepEP: {error}") from None
    nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden * 2, ranks) for config in configs)
    rdma_bytes = 0
    if low_latency_tokens:
        rdma_bytes = buffer.get_low_latency_rdma_size_hint(
            low_latency_tokens, hidden, ranks, num_experts
        )
    return buffer(
        group,
        nvl_bytes,
        rdma_bytes,
        low_latency_mode=bool(low_latency_tokens),
        num_qps_per_rank=num_experts // ranks,
        explicitly_destroy=True,
    )
