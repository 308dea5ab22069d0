"""What every model family's top module shares: the forward through its decoder stack, the LM head
(tied to the embedding or not), and the Hugging Face names fused into one parameter on load."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.attention import AttentionMetadata


class CausalLM(nn.Module):
    """Subclasses set ``model`` (a ``DecoderStack``), ``tie_word_embeddings`` and, if untied, ``lm_head``."""

    # checkpoint name -> (fused parameter, shard index)
    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # whether a decode forward can be captured in a CUDA graph (no host sync, static shapes)
    supports_cuda_graphs = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tie_word_embeddings:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)  # an nn.Linear without bias, or an NVFP4Linear
