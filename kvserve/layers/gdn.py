"""Gated DeltaNet (GDN) token mixer of one linear-attention layer (Qwen3-Next, Qwen3.5/3.6).

Per token: project to q|k|v (+ z, b, a), short causal depthwise conv over q|k|v with SiLU, L2-normalised
q/k, gates ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, the gated delta
rule over a per-value-head state ``S`` (K x V, float32), a plain gated RMSNorm ``w * norm(o) *
silu(z)`` per value head, then ``out_proj``. Value head ``hv`` reads key head ``hv // (HV / H)``.

Each sequence owns a state slot: the conv state (the last ``W - 1`` raw conv inputs, model dtype)
and the SSM state (float32). The model runner binds one tensor of each per layer (``bind_state``);
``forward`` reads a slot's state when ``meta.has_initial_state`` says the sequence has earlier
tokens, else starts from zeros, and writes the final states back into the slot in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvserve.kernels import gdn_reference as gdn
from kvserve.layers.attention import AttentionMetadata

# a step whose longest prefill chunk is longer takes the chunk-parallel delta rule (triton backend)
CHUNKED_MIN_TOKENS = 32


class GatedRMSNorm(nn.Module):
    """``weight * norm(x) * silu(z)`` over the last dim (one value head); weight init ones."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = False  # one Triton kernel (kernels/triton_layers.py), set by the model runner

    def forward(self, x: torch.Tensor, z: torch.Tensor, inv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``inv_scale`` (fused only): the output as the float8_e4m3fn codes an FP8 layer's static
        quantiser makes of it (``FP8Linear.forward_fp8``), one launch for both."""
        if self.fused:
            from kvserve.kernels import triton_layers

            return triton_layers.gated_rms_norm(x, z, self.weight, self.eps, inv_scale)
        assert inv_scale is None, "a quantized output needs the fused kernel"
        return gdn.gated_rms_norm(x, z, self.weight, self.eps)


def _check(cfg: Any) -> None:
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported for Gated DeltaNet layers. Supported: ['silu']")
    gate = getattr(cfg, "output_gate_type", None)
    if gate not in (None, "swish", "silu"):
        raise ValueError(f"output_gate_type {gate!r} is not supported. Supported: ['swish', 'silu']")
    h, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if hv % h:
        raise ValueError(
            f"linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={h}: "
            "grouped value heads need HV % H == 0"
        )


class GatedDeltaNet(nn.Module):
    """The GDN mixer; parameter names follow the Hugging Face checkpoints (``linear_attn.*``).

    ``grouped_layout``: Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` (rows grouped per key
    head: [q_g | k_g | v_g (r heads) | z_g (r heads)] and [b_g (r) | a_g (r)]); otherwise Qwen3.5's
    separate ``in_proj_qkv`` ([q | k | v]), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, loaded as
    vLLM packs them: the shards of ``in_proj_qkvz`` (qkv | z) and of ``in_proj_ba`` (b | a), two
    GEMMs, so that each keeps its own scheme in a ModelOpt export (the 27B's qkv and z are FP8, b and
    a unquantized)."""

    def __init__(self, cfg: Any, layer_idx: int, grouped_layout: bool) -> None:
        super().__init__()
        _check(cfg)
        self.layer_idx = layer_idx
        self.grouped_layout = grouped_layout
        self.hidden_size = cfg.hidden_size
        self.num_k_heads = cfg.linear_num_key_heads
        self.num_v_heads = cfg.linear_num_value_heads
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        hidden = cfg.hidden_size
        if grouped_layout:
            self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.num_v_heads, bias=False)
        else:  # the checkpoint's in_proj_qkv | in_proj_z and in_proj_b | in_proj_a as two GEMMs (as vLLM)
            self.qkvz_sizes, self.ba_sizes = [self.conv_dim, self.value_dim], [self.num_v_heads] * 2
            self.in_proj_qkvz = nn.Linear(hidden, sum(self.qkvz_sizes), bias=False)
            self.in_proj_qkvz.shard_sizes = self.qkvz_sizes
            self.in_proj_ba = nn.Linear(hidden, sum(self.ba_sizes), bias=False)
            self.in_proj_ba.shard_sizes = self.ba_sizes
        # depthwise causal conv, stored like nn.Conv1d's weight: [conv_dim, 1, W]
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_dim, 1, self.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, self.eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.conv_state: torch.Tensor | None = None  # [num_slots, conv_dim, W - 1], bound by the runner
        self.ssm_state: torch.Tensor | None = None  # [num_slots, HV, K, V] float32
        self.backend = "reference"

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per-sequence (conv state, SSM state) shapes: ((conv_dim, W - 1), (HV, K, V))."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor, backend: str = "reference") -> None:
        """Attach the state pool rows of this layer; ``backend`` "triton" runs the step's conv and
        delta rule as two Triton launches over all its sequences (kernels/triton_gdn.py)."""
        conv_shape, ssm_shape = self.state_shapes()
        assert tuple(conv_state.shape[1:]) == conv_shape, (tuple(conv_state.shape), conv_shape)
        assert tuple(ssm_state.shape[1:]) == ssm_shape, (tuple(ssm_state.shape), ssm_shape)
        assert conv_state.shape[0] == ssm_state.shape[0]
        self.conv_state = conv_state
        self.ssm_state = ssm_state
        self.backend = backend

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> mixed q|k|v [T, conv_dim] (conv channel order), z [T, HV, V], b [T, HV], a [T, HV]."""
        t = x.shape[0]
        if not self.grouped_layout:  # views of the two outputs
            mixed, z = self.in_proj_qkvz(x).split(self.qkvz_sizes, dim=-1)
            b, a = self.in_proj_ba(x).split(self.ba_sizes, dim=-1)
            return mixed, z.view(t, self.num_v_heads, self.head_v_dim), b, a
        r = self.num_v_heads // self.num_k_heads
        k_dim, rv = self.head_k_dim, r * self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(t, self.num_k_heads, 2 * k_dim + 2 * rv)
        q, k, v, z = qkvz.split([k_dim, k_dim, rv, rv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        z = z.reshape(t, self.num_v_heads, self.head_v_dim)
        return mixed, z, b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads)

    def _forward_triton(
        self, mixed: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """All sequences of the step: the conv, then the delta rule (states in place), both over all
        tokens in parallel (kernels/triton_gdn_chunk.py) when a prefill chunk is longer than
        ``CHUNKED_MIN_TOKENS``, else walking each sequence token by token (decodes, short chunks)."""
        from kvserve.kernels import triton_gdn

        qsl, slots, has = meta.query_start_loc, meta.state_slots_t, meta.has_initial_state_t
        assert qsl is not None and slots is not None and has is not None, "triton GDN needs device metadata"
        chunked = meta.max_query_len > CHUNKED_MIN_TOKENS
        plan = meta.gdn_chunks if chunked else None
        y = triton_gdn.causal_conv1d_varlen(mixed, weight, self.conv_state, qsl, slots, has, plan)
        t = y.shape[0]
        q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(t, self.num_k_heads, self.head_k_dim)
        k = k.view(t, self.num_k_heads, self.head_k_dim)
        v = v.view(t, self.num_v_heads, self.head_v_dim)
        if plan is not None:
            from kvserve.kernels import triton_gdn_chunk

            return triton_gdn_chunk.chunk_gated_delta_rule(
                q, k, v, a, b, self.A_log, self.dt_bias, self.ssm_state, qsl, slots, has, plan
            )
        return triton_gdn.gated_delta_rule_varlen(
            q, k, v, a, b, self.A_log, self.dt_bias, self.ssm_state, qsl, slots, has
        )

    def _norm_and_project(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``out_proj(norm(out, z))``; an FP8 ``out_proj`` (``forward_fp8``) gets its quantized input
        from the fused norm's own launch instead of its quantiser's."""
        t = out.shape[0]
        if self.norm.fused and hasattr(self.out_proj, "forward_fp8"):
            xq = self.norm(out, z, self.out_proj.inv_input_scale)
            return self.out_proj.forward_fp8(xq.reshape(t, self.value_dim), dtype)
        return self.out_proj(self.norm(out, z).reshape(t, self.value_dim))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden] (sequences contiguous, ``meta.query_lens`` tokens each) -> [T, hidden]."""
        assert self.conv_state is not None and self.ssm_state is not None, "GDN state not bound"
        assert meta.state_slots is not None and meta.has_initial_state is not None, "no state slots in metadata"
        mixed, z, b, a = self._project(x)
        weight = self.conv1d.weight.squeeze(1)
        if self.backend == "triton":
            out = self._forward_triton(mixed, weight, a, b, meta)
            return self._norm_and_project(out, z, x.dtype)
        g, beta = gdn.gdn_gates(self.A_log, a, self.dt_bias, b)
        out = torch.empty(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)
        start = 0
        for n, slot, has_state in zip(meta.query_lens, meta.state_slots, meta.has_initial_state):
            if n == 0:
                continue
            end = start + n
            conv0 = self.conv_state[slot] if has_state else None
            ssm0 = self.ssm_state[slot] if has_state else None
            y, conv_new = gdn.causal_conv1d(mixed[start:end], weight, conv0)
            q, k, v = y.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            rule = gdn.recurrent_gated_delta_rule if n == 1 else gdn.chunk_gated_delta_rule
            o, ssm_new = rule(
                q.reshape(n, self.num_k_heads, self.head_k_dim),
                k.reshape(n, self.num_k_heads, self.head_k_dim),
                v.reshape(n, self.num_v_heads, self.head_v_dim),
                g[start:end], beta[start:end], initial_state=ssm0, use_qk_l2norm=True,
            )
            out[start:end] = o
            self.conv_state[slot].copy_(conv_new)
            self.ssm_state[slot].copy_(ssm_new)
            start = end
        o = self.norm(out, z)
        return self.out_proj(o.reshape(x.shape[0], self.value_dim))
