"""The pre-norm residual decoder layer shared by every model: ``h = x + mix(norm1(x))``,
``y = h + ffn(norm2(h))``, with the residual add fused into the next norm (``norm(x, residual)``);
and the stack of them between the embedding and the final norm."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.layers.attention import AttentionMetadata


class PreNormDecoderLayer(nn.Module):
    """Subclasses set ``input_layernorm``, ``post_attention_layernorm``, ``mlp`` and define ``mix``."""

    def mix(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.mix(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderStack(nn.Module):
    """Embedding -> pre-norm decoder layers -> final norm. Subclasses set ``embed_tokens``,
    ``layers`` (of ``PreNormDecoderLayer``) and ``norm``."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x
