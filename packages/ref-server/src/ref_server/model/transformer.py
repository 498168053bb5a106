"""DeepSeek-V3 in plain torch, top to bottom: blocks of MLA and MLP or MoE, the model.

Two ways through the model:
- `forward(input_ids)`: a full causal pass without cache, attention on decompressed heads
  (SDPA); the same contract as `transformers`' forward.
- `forward_step(batch, cache)`: new tokens of several sequences against a paged latent cache,
  as one batch or as two microbatches overlapped (`overlap_sched`). The step is an operation
  list (`operations`): each layer's ops in DeepSeek's order, with `Yield`s where its prefill or
  decode schedule lets the other microbatch run.

Module and parameter names follow the Hugging Face checkpoint, so loading is name for name.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from overlap_sched import Op, State, Yield, run, run_overlapped
from ref_server.model.args import ModelArgs
from ref_server.model.attention import MLA_KERNELS, Attention, DecodeAttention
from ref_server.model.cache import PagedKVCache
from ref_server.model.kernel_set import OURS, KernelSet
from ref_server.model.layers import MLP, RMSNorm, Rope
from ref_server.model.moe import MoE
from ref_server.model.step import StepBatch, StepMetadata

# DeepSeek's two schedules for an MoE layer (as SGLang writes them), "|" for a Yield. Prefill
# runs the microbatches 0 stages apart: one's dispatch and combine overlap the other's attention
# and experts. Decode runs them 2 of 5 stages apart.
SCHEDULES = {
    "prefill": "comm_prepare_attn attn.prepare attn.core comm_prepare_mlp gate select_experts "
    "dispatch_a | dispatch_b experts combine_a | shared_experts combine_b output postprocess",
    "decode": "comm_prepare_attn attn.prepare | attn.core comm_prepare_mlp gate select_experts | "
    "dispatch_a shared_experts | dispatch_b experts combine_a | combine_b | output postprocess",
}
DENSE_LAYER = "comm_prepare_attn attn.prepare attn.core comm_prepare_mlp mlp postprocess"
DELTA_STAGES = {"prefill": 0, "decode": 2}


class Block(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        layer: int,
        expert_parallel=None,
        num_physical_experts=None,
        decode: DecodeAttention = MLA_KERNELS,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, decode)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.is_moe_layer(layer):
            self.mlp = MoE(args, expert_parallel, num_physical_experts)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def forward(self, x: torch.Tensor, rotation) -> torch.Tensor:
        """A causal pass over whole sequences."""
        x = x + self.self_attn(self.input_layernorm(x), rotation)
        return x + self.mlp(self.post_attention_layernorm(x))

    def operations(self, schedule: str, kv: torch.Tensor, index_keys=None) -> list:
        """This layer's ops in `schedule` ("prefill" or "decode"), kv: its cache, index_keys:
        its indexer's (`cache.IndexKeys`, in a sparse model)."""
        moe = isinstance(self.mlp, MoE)
        names = (SCHEDULES[schedule] if moe else DENSE_LAYER).split()
        ops = {
            "comm_prepare_attn": self.comm_prepare_attn,
            "attn.prepare": partial(self.self_attn.prepare, kv=kv, index_keys=index_keys),
            "attn.core": partial(self.self_attn.core, kv=kv, index_keys=index_keys),
            "comm_prepare_mlp": self.comm_prepare_mlp,
            "mlp": self.dense_mlp,
            "postprocess": self.postprocess,
        }
        return [
            Yield()
            if name == "|"
            else Op(f"L{self.layer}.{name}", ops.get(name) or self.mlp.operation(name))
            for name in names
        ]

    # State: hidden `[n, hidden]` in and out, plus hidden_update (and after an MoE layer with
    # shared experts, hidden_update_shared) after a layer: the hidden state is their sum, added
    # where the next norm runs, in its kernel; attn_in / attn_out and mlp_in / mlp_out (and
    # mlp_out_shared) between this layer's parts; residual across them.

    def comm_prepare_attn(self, state) -> None:
        x, update = state.pop("hidden"), state.pop("hidden_update", None)
        shared = state.pop("hidden_update_shared", None)
        if update is None:  # the first layer
            state.residual, state.attn_in = x, self.input_layernorm(x)
        else:
            state.residual, state.attn_in = self.input_layernorm.add_and_norm(x, update, shared)

    def comm_prepare_mlp(self, state) -> None:
        x, update = state.pop("residual"), state.pop("attn_out")
        state.residual, state.mlp_in = self.post_attention_layernorm.add_and_norm(x, update)

    def dense_mlp(self, state) -> None:
        state.mlp_out = self.mlp(state.pop("mlp_in"))

    def postprocess(self, state) -> None:
        state.hidden, state.hidden_update = state.pop("residual"), state.pop("mlp_out")
        if "mlp_out_shared" in state:
            state.hidden_update_shared = state.pop("mlp_out_shared")


class Transformer(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        expert_parallel=None,
        num_physical_experts: int | None = None,
        kernels: KernelSet = OURS,
    ) -> None:
        """num_physical_experts: each MoE layer's expert slots when the instance balances its
        experts (`MoE`); None: one slot per routed expert. kernels: whose kernels run decode
        attention here (the FP8 GEMMs and the exchange are given to `use_fp8` and the
        `expert_parallel`; `ref_server.model.from_args` builds all three)."""
        super().__init__()
        self.args = args
        self.expert_parallel = expert_parallel
        self.kernels = kernels
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            Block(args, i, expert_parallel, num_physical_experts, kernels.decode_attention)
            for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rope = Rope(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.mtp = None  # the MTP module (`ref_server.model.mtp`), which `from_args` adds

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids `[b, t]` int64 to logits `[b, t, vocab]` float32 (no cache)."""
        return self.lm_head(self.hidden_states(input_ids)).float()

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids `[b, t]` to the output hidden states `[b, t, hidden]`, after the final
        norm (what the head and the MTP module read), without cache."""
        x, rotation = self.embed_tokens(input_ids), self.full_pass_rotation(input_ids)
        for layer in self.layers:
            x = layer(x, rotation)
        return self.norm(x)

    def full_pass_rotation(self, input_ids: torch.Tensor):
        """Rope angles of positions 0 .. t - 1 for input_ids `[b, t]`."""
        dtype = self.embed_tokens.weight.dtype
        return self.rope(torch.arange(input_ids.shape[1], device=input_ids.device), dtype)

    def moe_layers(self, mtp: bool = False) -> list[MoE]:
        """The model's MoE layers; mtp: and the MTP module's after them, where there is one."""
        layers = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]
        if mtp and self.mtp is not None and isinstance(self.mtp.mlp, MoE):
            layers.append(self.mtp.mlp)
        return layers

    def operations(self, cache: PagedKVCache, schedule: str) -> list:
        """A whole cached step as one op list: embed, every layer's ops, the head."""
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; expected one of {list(SCHEDULES)}")
        if problem := self.kernels.decode_attention.cache_problem(cache):
            raise ValueError(f"kernels {self.kernels.spec!r}: {problem}")
        ops = [Op("embed", self.embed)]
        n = len(self.layers)
        for layer, kv, index_keys in zip(
            self.layers, cache.layers[:n], cache.index_keys[:n], strict=True
        ):
            ops += layer.operations(schedule, kv, index_keys)
        return [*ops, Op("head", self.head)]

    def mtp_operations(self, cache: PagedKVCache, schedule: str) -> list:
        """A cached step of the MTP module: its input, its layer (the cache's last), its head.
        State in as `operations`' (input_ids: each row's next token) plus previous_hidden
        `[n, hidden]`, the model's (or the module's) output hidden states."""
        if self.mtp is None:
            raise ValueError("this model has no MTP module (num_nextn_predict_layers 0)")
        if len(cache.layers) != len(self.layers) + 1:
            raise ValueError("the cache has no layer for the MTP module")
        layer = self.mtp.operations(schedule, cache.layers[-1], cache.index_keys[-1])
        return [Op("mtp.embed", self.mtp_embed), *layer, Op("mtp.head", self.mtp_head)]

    # State in: step (`StepMetadata`, None on a rank without tokens), input_ids `[n]`.
    # State out: logits `[b, vocab]` float32 (None without tokens).

    def embed(self, state) -> None:
        """The tokens' embeddings and rope angles, and in decode the attention's schedule,
        which every layer shares."""
        step = state.step
        if step is None:
            state.hidden = self.embed_tokens.weight.new_zeros(0, self.args.hidden_size)
            state.rotation = None
            return
        x = self.embed_tokens(state.input_ids)
        state.rotation = self.rope(step.positions, x.dtype)
        state.hidden = x
        if step.is_decode:
            heads = self.args.num_attention_heads * step.s_q
            state.decode_schedule = self.kernels.decode_attention.schedule(
                step.cache_seqlens, heads
            )

    def mtp_embed(self, state) -> None:
        self.embed(state)
        if state.step is not None:
            state.hidden = self.mtp.project(state.pop("hidden"), state.pop("previous_hidden"))

    def head(self, state) -> None:
        self._head(state, self.norm)

    def mtp_head(self, state) -> None:
        self._head(state, self.mtp.shared_head.norm)

    def _head(self, state, norm) -> None:
        """logits (and output_hidden, the normed rows they come from) of the step's last rows."""
        x, update, step = state.pop("hidden"), state.pop("hidden_update"), state.step
        shared = state.pop("hidden_update_shared", None)
        if step is None:
            state.logits = None
            return
        if step.last_rows is not None:
            x, update = x[step.last_rows], update[step.last_rows]
            shared = None if shared is None else shared[step.last_rows]
        state.output_hidden = norm.add_and_norm(x, update, shared)[1]
        state.logits = self.lm_head(state.output_hidden).float()

    @torch.no_grad()
    def forward_step(
        self, batch: StepBatch, cache: PagedKVCache, split=None, low_latency: bool | None = None
    ) -> torch.Tensor:
        """The new tokens of `batch` through the cache; logits `[b, vocab]` float32 of each
        sequence's last new token. split (an `overlap_sched.Split`): run two microbatches
        overlapped, in the schedule of the batch's kind. low_latency: the MoE exchanges go
        through ep_comm's low-latency mode (every expert-parallel rank must choose alike);
        None: for a decode batch, when the mode is set up and the batch fits it."""
        schedule = "decode" if batch.is_decode else "prefill"
        if low_latency is None:
            ep = self.expert_parallel
            low_latency = bool(batch.is_decode and ep and ep.low_latency_fits(batch.num_tokens))
        parts = [batch] if split is None else batch.split(split)
        inputs = [(p.input_ids.to(cache.device), p.metadata(cache)) for p in parts]
        logits = self.run_step(inputs, cache, schedule, low_latency=low_latency)
        if split is not None and split.cut:  # a cut sequence's last token is in B: drop A's row
            a_rows = len(split.seqs[0])
            logits = torch.cat([logits[: a_rows - 1], logits[a_rows:]])
        return logits

    @torch.no_grad()
    def every_row_step(
        self,
        batch: StepBatch,
        cache: PagedKVCache,
        previous_hidden: torch.Tensor | None = None,
        split=None,
        low_latency: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits `[n, vocab]` float32 and output hidden states `[n, hidden]` of every new token
        of `batch` (speculative decoding: a verify step, and the MTP module's drafts): the
        model's, or with previous_hidden `[n, hidden]` the MTP module's, which reads
        batch.input_ids as the tokens after those previous_hidden belong to. split and
        low_latency as `forward_step`'s (the model's step only: the module's runs as one
        batch, its exchanges in the normal mode)."""
        parts = [batch] if split is None else batch.split(split)
        inputs = [(p.input_ids.to(cache.device), p.metadata(cache, every_row=True)) for p in parts]
        return self.every_row(inputs, cache, previous_hidden, low_latency)

    @torch.no_grad()
    def every_row(
        self,
        inputs,
        cache: PagedKVCache,
        previous_hidden: torch.Tensor | None = None,
        low_latency: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`every_row_step` on device tensors alone (what `SpeculativeSteps` captures): inputs,
        one (input_ids `[n]`, StepMetadata whose last_rows is None) pair per microbatch, one or
        two (one with previous_hidden)."""
        states = [self._state(ids, step, 0, low_latency) for ids, step in inputs]
        schedule = "decode" if inputs[0][1].is_decode else "prefill"
        if previous_hidden is None:
            ops = self.operations(cache, schedule)
        else:
            ops = self.mtp_operations(cache, schedule)
            (state,) = states
            state.previous_hidden = previous_hidden
        self._run(ops, schedule, states)
        return torch.cat([s.logits for s in states]), torch.cat([s.output_hidden for s in states])

    @torch.no_grad()
    def run_step(
        self,
        inputs,
        cache: PagedKVCache,
        schedule: str,
        num_worst_tokens: int = 0,
        recorder=None,
        low_latency: bool = False,
    ):
        """`forward_step` on device tensors alone (what `DecodeGraphs` captures): inputs, one
        (input_ids, StepMetadata) pair per microbatch, one or two. num_worst_tokens: the
        expert-parallel dispatch's fixed output rows per microbatch (0: as received);
        recorder: an `overlap_sched.Recorder` that times every op; low_latency: exchange through
        ep_comm's low-latency mode (decode)."""
        states = [self._state(ids, step, num_worst_tokens, low_latency) for ids, step in inputs]
        self._run(self.operations(cache, schedule), schedule, states, recorder)
        logits = [s.logits for s in states]
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def idle_step(
        self,
        cache: PagedKVCache,
        schedule: str | None = None,
        num_worst_tokens: int = 0,
        low_latency: bool = False,
        mtp: bool = False,
    ):
        """What an expert-parallel rank without tokens runs while its peers step: every MoE
        layer's exchange with no rows of its own, so its experts serve the peers' tokens;
        schedule: the peers' two-microbatch schedule, None when they run one batch;
        low_latency: whether their exchanges go through the low-latency mode; mtp: the peers
        step the MTP module (one batch, `every_row_step`)."""
        count = 1 if schedule is None else 2
        states = [self._state(None, None, num_worst_tokens, low_latency) for _ in range(count)]
        schedule = schedule or "prefill"
        ops = self.mtp_operations(cache, schedule) if mtp else self.operations(cache, schedule)
        self._run(ops, schedule, states)

    @staticmethod
    def _run(ops: list, schedule: str, states: list[State], recorder=None):
        if len(states) == 1:
            run(ops, states[0], recorder)
        else:
            run_overlapped(ops, states, DELTA_STAGES[schedule], recorder)

    @staticmethod
    def _state(input_ids, step: StepMetadata | None, num_worst_tokens: int, low_latency) -> State:
        state = State(num_tokens=0 if step is None else step.num_tokens, step=step)
        state.input_ids = input_ids
        if num_worst_tokens:
            state.num_worst_tokens = num_worst_tokens
        if low_latency:
            state.low_latency = True
        return state
