"""Llama-family decoder: Llama 2/3, SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from kvserve.layers.attention import Attention, AttentionMetadata, head_geometry
from kvserve.layers.decoder import DecoderStack, PreNormDecoderLayer
from kvserve.layers.mlp import SwiGLUMLP
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding, rope_parameters
from kvserve.loader.weights import WeightLoader
from kvserve.models.causal_lm import CausalLM


class LlamaAttentionBlock(nn.Module):
    def __init__(self, cfg: Any, architecture: str, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = head_geometry(cfg)
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        bias = architecture == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False))
        o_bias = bool(getattr(cfg, "attention_bias", False)) and architecture != "Qwen2ForCausalLM"
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.qkv_proj.shard_sizes = [self.q_size, self.kv_size, self.kv_size]
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.qk_norm = architecture == "Qwen3ForCausalLM"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, cfg.rms_norm_eps)
        self.rotary_emb = rope
        self.attn = Attention(self.num_heads, self.head_size, self.num_kv_heads, self.head_size**-0.5, layer_idx)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_size)
        k = k.view(-1, self.num_kv_heads, self.head_size)
        v = v.view(-1, self.num_kv_heads, self.head_size)
        if self.qk_norm:  # (Qwen3: per-head norms, then the rotation; one kernel when fused)
            q, k = self.rotary_emb.norm_and_rotate(positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(SwiGLUMLP):
    def __init__(self, cfg: Any):
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported. Supported: ['silu']")
        super().__init__(cfg.hidden_size, cfg.intermediate_size, bias=bool(getattr(cfg, "mlp_bias", False)))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: Any, architecture: str, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttentionBlock(cfg, architecture, layer_idx, rope)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mix(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.self_attn(positions, x, meta)


class LlamaModel(DecoderStack):
    def __init__(self, cfg: Any, architecture: str):
        super().__init__()
        head_size = head_geometry(cfg)[2]
        rope = RotaryEmbedding(head_size, cfg.max_position_embeddings, rope_parameters(cfg))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, architecture, i, rope) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def sliding_window_layers(cfg: Any) -> list[int]:
    """Layers that Hugging Face runs with sliding-window attention for this config (none for Llama)."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return []
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if getattr(cfg, "use_sliding_window", False):  # transformers 4 configs have no layer_types
        return list(range(getattr(cfg, "max_window_layers", 0), cfg.num_hidden_layers))
    return []


def check_supported(cfg: Any) -> None:
    """Refuse configs whose attention kvserve would silently compute differently."""
    layers = sliding_window_layers(cfg)
    if layers and cfg.sliding_window < cfg.max_position_embeddings:
        raise ValueError(
            f"Sliding-window attention (sliding_window={cfg.sliding_window} on layers {layers}) is not "
            "supported by kvserve: every layer attends to the full context. Use a checkpoint with "
            "use_sliding_window=false."
        )


class LlamaForCausalLM(CausalLM):
    """Decoder + LM head; weights load by Hugging Face name (q/k/v and gate/up are fused here)."""

    def __init__(self, cfg: Any, architecture: str):
        super().__init__()
        check_supported(cfg)
        self.config = cfg
        self.model = LlamaModel(cfg, architecture)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self, self.stacked_params)
        skip = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.tie_word_embeddings else ())
        for name, tensor in weights:
            if name.endswith(skip):
                continue
            loader.load(name, tensor)
        loader.finish()
