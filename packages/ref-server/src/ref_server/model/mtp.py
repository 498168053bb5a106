"""DeepSeek-V3's multi-token-prediction (MTP) module: the draft model of speculative decoding.

One more decoder layer beside the model's own. At position i it reads the model's output
hidden state h_i (after the final norm) and the embedding of token i + 1, and predicts token
i + 2:

    x = eh_proj(concat[enorm(embed(token i + 1)), hnorm(h_i)])
    h'_i = shared_head.norm(block(x))     logits = lm_head(h'_i)

The block is a decoder layer like the model's MoE layers, with its own slot in the paged cache
(rows at the model's positions, in the same pages). It shares the model's embedding and output
head: the checkpoint's copies of them in layer `num_hidden_layers` equal the model's. Drafting a
second token applies the module to its own output: h'_i and the drafted token.
Checkpoint names are the layer's: `model.layers.{num_hidden_layers}.*`.
"""

from __future__ import annotations

import torch
from torch import nn

from ref_server.model.args import ModelArgs
from ref_server.model.layers import RMSNorm
from ref_server.model.transformer import Block


class SharedHead(nn.Module):
    """The checkpoint's `shared_head`: its norm (its head is the model's `lm_head`)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class MTP(Block):
    """The module; `Transformer.mtp_operations` runs it over the cache."""

    def __init__(self, args: ModelArgs, expert_parallel, num_physical_experts, decode) -> None:
        super().__init__(
            args, args.num_hidden_layers, expert_parallel, num_physical_experts, decode
        )
        self.enorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hnorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.shared_head = SharedHead(args)

    def project(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input from the next tokens' embeddings and the hidden states `[n, h]`."""
        return self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))

    def full_pass(self, embedded: torch.Tensor, hidden: torch.Tensor, rotation) -> torch.Tensor:
        """Whole sequences without cache: embedded and hidden `[b, t, h]` (row i: token i + 1's
        embedding, the model's h_i) to the module's normed outputs `[b, t, h]`."""
        return self.shared_head.norm(self(self.project(embedded, hidden), rotation))
