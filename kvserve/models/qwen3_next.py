"""Hybrid Gated-DeltaNet + gated full-attention decoders: Qwen3-Next, Qwen3.5 / 3.6 (dense and MoE).

Layer ``i`` mixes tokens with a Gated DeltaNet (``linear_attn``, :mod:`kvserve.layers.gdn`) or with
gated softmax attention over the paged KV cache (``self_attn``), per ``layer_types`` (else every
``full_attention_interval``-th layer is full attention). Every layer norm, the final norm and
q_norm/k_norm are zero-centred (``(1 + w)``). The FFN is a SwiGLU MLP or a sparse MoE block
(softmax top-k router + experts + a sigmoid-gated shared expert).

The ``*ForConditionalGeneration`` (image-text) checkpoints load as text-only causal LMs: the text
config is ``text_config``, ``model.language_model.*`` becomes ``model.*``, and ``model.visual.*``
(vision tower) and ``mtp.*`` (multi-token-prediction head) are skipped.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.attention import Attention, AttentionMetadata, head_geometry
from kvserve.layers.decoder import DecoderStack, PreNormDecoderLayer
from kvserve.layers.gdn import GatedDeltaNet
from kvserve.layers.mlp import SwiGLUMLP
from kvserve.layers.moe import routed_swiglu
from kvserve.layers.norm import ZeroCenteredRMSNorm
from kvserve.layers.rotary import RotaryEmbedding, rope_parameters
from kvserve.loader.weights import WeightLoader, WeightLoadError
from kvserve.models.causal_lm import CausalLM

# architecture -> (GDN grouped in_proj_qkvz/in_proj_ba layout, FFN kind: "next" | "dense" | "moe")
HYBRID_ARCHITECTURES: dict[str, tuple[bool, str]] = {
    "Qwen3NextForCausalLM": (True, "next"),
    "Qwen3_5ForCausalLM": (False, "dense"),
    "Qwen3_5MoeForCausalLM": (False, "moe"),
    "Qwen3_5ForConditionalGeneration": (False, "dense"),
    "Qwen3_5MoeForConditionalGeneration": (False, "moe"),
}

_LAYER_TYPES = ("linear_attention", "full_attention")
_SKIP_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
# a routed expert's weight, or (NVFP4 experts kept quantized: layers/quant_experts.py) its scales
_EXPERT_RE = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale|weight_scale_2|input_scale)$")
# per-expert checkpoint tensor -> the stacked parameter's suffix (input_scale: FP8 experts kept quantized)
_EXPERT_PART = {"weight": "", "weight_scale": "_scale", "weight_scale_2": "_scale_2", "input_scale": "_input_scale"}


def hf_to_kvserve_name(name: str) -> str | None:
    """A checkpoint tensor name -> this model's name; ``None`` for tensors a text-only model skips
    (vision tower, MTP head)."""
    if name.startswith(_SKIP_PREFIXES):
        return None
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def renamed_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors under this model's names (skipped ones dropped), so that the KV-scale
    loader sees ``model.layers.N.self_attn.*`` also in image-text checkpoints."""
    for name, tensor in weights:
        mapped = hf_to_kvserve_name(name)
        if mapped is not None:
            yield mapped, tensor


def text_config(hf_config: Any) -> Any:
    """The language model's config (``text_config`` of an image-text config, else the config)."""
    sub = getattr(hf_config, "text_config", None)
    return sub if sub is not None else hf_config


def layer_types(cfg: Any) -> list[str]:
    """'linear_attention' / 'full_attention' per layer (``layer_types``, else every
    ``full_attention_interval``-th layer, default 4, is full attention)."""
    types = getattr(cfg, "layer_types", None)
    n = cfg.num_hidden_layers
    if types is None:
        interval = getattr(cfg, "full_attention_interval", None) or 4
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    types = list(types)
    bad = sorted({t for t in types if t not in _LAYER_TYPES})
    if bad:
        raise ValueError(f"layer_types entries {bad} are not supported. Supported: {list(_LAYER_TYPES)}")
    if len(types) < n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    return types[:n]


def check_supported(cfg: Any, ffn: str) -> None:
    """Refuse configs that kvserve would compute differently from transformers."""
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported. Supported: ['silu']")
    if getattr(cfg, "attn_output_gate", True) is False:
        raise ValueError("attn_output_gate=False is not supported: kvserve's Qwen3-Next/3.5 attention is always gated")
    if ffn == "next" and cfg.num_experts > 0 and getattr(cfg, "decoder_sparse_step", 1) < 1:
        raise ValueError(f"decoder_sparse_step={cfg.decoder_sparse_step} is not supported (must be >= 1)")
    if ffn in ("moe", "next") and getattr(cfg, "num_experts", 0) > 0:
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(
                f"num_experts_per_tok={cfg.num_experts_per_tok} is not in [1, num_experts={cfg.num_experts}]"
            )
        if getattr(cfg, "shared_expert_intermediate_size", 1) <= 0:
            raise ValueError(
                f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size} is not supported (must be > 0)"
            )


def _rotary(cfg: Any, head_size: int) -> RotaryEmbedding:
    params = rope_parameters(cfg)
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    factor = 0.25 if factor is None else float(factor)  # the families' default (transformers __post_init__)
    rot_dim = int(head_size * factor)
    if rot_dim <= 0 or rot_dim % 2 or rot_dim > head_size:
        raise ValueError(
            f"partial_rotary_factor={factor} gives rotary dim {rot_dim} for head_dim={head_size}; "
            "it must be even and in (0, head_dim]"
        )
    # M-RoPE (mrope_section / mrope_interleaved): text-only tokens have equal t/h/w positions, so it
    # is plain 1-D RoPE on the same rotary slice.
    return RotaryEmbedding(head_size, cfg.max_position_embeddings, params, rot_dim=rot_dim)


class GatedAttentionBlock(nn.Module):
    """q_proj gives per head [query | gate]; zero-centred q/k norms, partial NeoX RoPE, paged
    attention, ``o_proj(attn * sigmoid(gate))``. q/k/v are fused into ``qkv_proj``."""

    def __init__(self, cfg: Any, layer_idx: int, rope: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = head_geometry(cfg)
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=bias)
        self.qkv_proj.shard_sizes = [2 * self.q_size, self.kv_size, self.kv_size]
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_size, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_size, cfg.rms_norm_eps)
        self.rotary_emb = rope
        self.attn = Attention(self.num_heads, self.head_size, self.num_kv_heads, self.head_size**-0.5, layer_idx)
        self.fused = False  # the output gate in one Triton kernel (kernels/triton_layers.py), set by the runner

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * self.head_size).chunk(2, dim=-1)
        k = k.view(t, self.num_kv_heads, self.head_size)
        v = v.view(t, self.num_kv_heads, self.head_size)
        q, k = self.rotary_emb.norm_and_rotate(positions, q, k, self.q_norm, self.k_norm)
        return self._gate_and_project(self.attn(q, k, v, meta), gate, x.dtype)

    def _gate_and_project(self, out: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``o_proj(out * sigmoid(gate))`` for out [T, Hq * D] (``Attention.forward``) and the gate
        [T, Hq, D] view; fused, one Triton kernel for the gate, which also writes an FP8 o_proj's
        quantized input (``forward_fp8``) instead of its quantiser's launch."""
        if self.fused:
            from kvserve.kernels.triton_layers import sigmoid_gate

            if hasattr(self.o_proj, "forward_fp8"):
                return self.o_proj.forward_fp8(sigmoid_gate(out, gate, self.o_proj.inv_input_scale), dtype)
            return self.o_proj(sigmoid_gate(out, gate))
        return self.o_proj(out * torch.sigmoid(gate.reshape(out.shape[0], self.q_size)))


class Experts(nn.Module):
    """Routed SwiGLU experts as 3-D tensors (transformers' layout): ``gate_up_proj`` [E, 2I, hidden]
    (gate rows first), ``down_proj`` [E, hidden, I]. Per-expert checkpoint tensors are copied in.
    ``fused`` (set by the runner for bf16 / fp16 on the triton backend): both GEMMs as grouped GEMMs
    over rows aligned to their experts on the device (``kernels/triton_moe``, no host sync; launches
    from the device's tuned table, ``kernels/moe_configs``); else the torch loop over experts below,
    the reference."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.intermediate = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))
        self.fused = False

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
                shared: SwiGLUMLP | None = None) -> torch.Tensor:
        """``shared`` (fused only; a shared expert of the experts' width): it runs as expert E of the
        grouped GEMMs, ``top_idx`` / ``top_w`` carrying its slot (``softmax_topk``'s ``shared_gate``)."""
        if self.fused:
            from kvserve.kernels.moe_configs import config_dtype, tuned_launch
            from kvserve.kernels.triton_moe import grouped_matmul

            launch = tuned_launch(self.num_experts, self.intermediate, x.shape[0], x.device, config_dtype(x.dtype))
            extra = {} if shared is None else {"gate_up_proj": shared.gate_up_proj.weight,
                                               "down_proj": shared.down_proj.weight}
            return routed_swiglu(x, top_idx, top_w, self.num_experts + (shared is not None), self.intermediate,
                                 x.shape[-1], lambda a, name, *rows, tiles: grouped_matmul(
                                     a, getattr(self, name), *rows, tiles=tiles, shared=extra.get(name)), launch)
        assert shared is None, "the shared expert runs in the grouped GEMMs only"
        out = torch.zeros_like(x)
        # token rows per expert, experts in ascending order (transformers' summation order)
        flat = top_idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, slots = order // top_idx.shape[1], order % top_idx.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok, pos = tokens[start : start + n], slots[start : start + n]
            start += n
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_w[tok, pos, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out


class SparseMoeBlock(nn.Module):
    """Softmax (fp32) top-k router, optionally renormalised, routed experts + a shared expert
    scaled by ``sigmoid(shared_expert_gate(x))``. When the experts run on the device
    (``experts_on_device``), the router and the gated add are Triton kernels too
    (``kernels/triton_router``), and a shared expert of the dense experts' width runs inside their
    grouped GEMMs (``shared_expert_in_grouped_gemms``); else the torch ops below, the reference."""

    def __init__(self, cfg: Any, norm_topk_prob: bool):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = SwiGLUMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        # batches up to this many tokens run the shared expert inside the grouped GEMMs (where it can):
        # on an H100 (moe_bench, 35B-A3B block, CUDA graphs) joined was 1-11% faster at 1-64 tokens and
        # 6-8% slower at 256 and 8,192 (benchmarks/RESULTS.md, MoE layer); benchmarks set it to compare
        self.shared_expert_join_max_tokens = 64

    @property
    def experts_on_device(self) -> bool:
        """Whether the routed experts run the device path (``fused``: grouped GEMMs; NVFP4 and FP8 experts always)."""
        return self.experts.fused is True

    @property
    def shared_expert_in_grouped_gemms(self) -> bool:
        """Whether the shared expert can run as expert E of the dense grouped GEMMs (one more row a
        token, weight ``sigmoid(gate)``): fused dense experts and a shared expert of their width in
        plain linears, as the 35B-A3B's (512 and 512); it does for batches of at most
        ``shared_expert_join_max_tokens`` tokens. Its GEMMs, SiLU-mul and gated add then go."""
        se, experts = self.shared_expert, self.experts
        return (isinstance(experts, Experts) and experts.fused is True and se.intermediate == experts.intermediate
                and all(type(m) is nn.Linear and m.bias is None for m in (se.gate_up_proj, se.down_proj))
                and type(self.shared_expert_gate) is nn.Linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.experts_on_device:
            from kvserve.kernels.triton_router import add_gated_shared, softmax_topk

            if x.shape[0] <= self.shared_expert_join_max_tokens and self.shared_expert_in_grouped_gemms:
                top_w, top_idx = softmax_topk(logits, self.top_k, self.norm_topk_prob,
                                              shared_gate=self.shared_expert_gate(x), weight_dtype=logits.dtype)
                return self.experts(x, top_idx, top_w, shared=self.shared_expert)
            shared = self.shared_expert(x)
            top_w, top_idx = softmax_topk(logits, self.top_k, self.norm_topk_prob, weight_dtype=logits.dtype)
            routed = self.experts(x, top_idx, top_w)
            return add_gated_shared(routed, shared, self.shared_expert_gate(x))
        shared = self.shared_expert(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        routed = self.experts(x, top_idx, top_w.to(logits.dtype))
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * shared


class HybridDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: Any, layer_idx: int, kind: str, grouped: bool, ffn: str, rope: RotaryEmbedding):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layer_idx, grouped)
        else:
            self.self_attn = GatedAttentionBlock(cfg, layer_idx, rope)
        if ffn == "moe":
            self.mlp: nn.Module = SparseMoeBlock(cfg, norm_topk_prob=True)  # Qwen3.5-MoE always renormalises
        elif ffn == "next" and (
            layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
            and cfg.num_experts > 0
            and (layer_idx + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0
        ):
            self.mlp = SparseMoeBlock(cfg, norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", True)))
        else:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mix(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.kind == "linear_attention":
            return self.linear_attn(x, meta)
        return self.self_attn(positions, x, meta)


class HybridModel(DecoderStack):
    def __init__(self, cfg: Any, grouped: bool, ffn: str):
        super().__init__()
        types = layer_types(cfg)
        head_size = head_geometry(cfg)[2]
        rope = _rotary(cfg, head_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(cfg, i, types[i], grouped, ffn, rope) for i in range(cfg.num_hidden_layers)
        )
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# Qwen3.5 / 3.6 checkpoint GDN projections -> (kvserve's fused Linear, shard): vLLM's packing
QWEN3_5_GDN_SHARDS = {
    "in_proj_qkv": ("in_proj_qkvz", 0),
    "in_proj_z": ("in_proj_qkvz", 1),
    "in_proj_b": ("in_proj_ba", 0),
    "in_proj_a": ("in_proj_ba", 1),
}


class Qwen3NextForCausalLM(CausalLM):
    """Hybrid GDN decoder + LM head for every architecture in ``HYBRID_ARCHITECTURES``; weights load
    by Hugging Face name (q/k/v and dense gate/up fused; per-expert or 3-D fused expert tensors)."""

    is_hybrid = True

    def __init__(self, hf_config: Any, architecture: str = "Qwen3NextForCausalLM"):
        super().__init__()
        if architecture not in HYBRID_ARCHITECTURES:
            raise ValueError(
                f"Architecture {architecture!r} is not a hybrid GDN model. Supported: {list(HYBRID_ARCHITECTURES)}"
            )
        grouped, ffn = HYBRID_ARCHITECTURES[architecture]
        cfg = text_config(hf_config)
        check_supported(cfg, ffn)
        self.architecture = architecture
        self.config = cfg
        if not grouped:  # Qwen3.5 / 3.6 keep the GDN input projections apart: packed as vLLM packs them
            self.stacked_params = {**self.stacked_params, **QWEN3_5_GDN_SHARDS}
        self.model = HybridModel(cfg, grouped, ffn)
        # transformers ties an image-text model by its top-level config. Given only the text config of
        # such a checkpoint, kvserve keeps lm_head and ties iff the checkpoint has no lm_head.weight
        # (transformers drops tied weights when saving).
        wrapper = architecture.endswith("ForConditionalGeneration") and hf_config is cfg
        self._tie_if_absent = wrapper
        self.tie_word_embeddings = not wrapper and bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def supports_cuda_graphs(self) -> bool:
        """Routed experts in the torch loop (``Experts`` not ``fused``) read their per-expert token
        counts on the host, which a graph cannot capture; fused and NVFP4 experts align on the device."""
        return not any(isinstance(m, Experts) and not m.fused for m in self.modules())

    def attention_layers(self) -> list[Attention]:
        """The paged-KV attention of the full-attention layers, in layer order."""
        return [layer.self_attn.attn for layer in self.model.layers if layer.kind == "full_attention"]

    def gdn_layers(self) -> list[GatedDeltaNet]:
        """The Gated DeltaNet mixers, in layer order."""
        return [layer.linear_attn for layer in self.model.layers if layer.kind == "linear_attention"]

    def _load_expert(self, loader: WeightLoader, m: re.Match, tensor: torch.Tensor, seen: dict) -> None:
        prefix, e, kind, part = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        pname = f"{prefix}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}{_EXPERT_PART[part]}"
        param = loader.params.get(pname)
        name = m.group(0)
        if param is None or e >= param.shape[0]:
            loader.unexpected.append(name)
            return
        dest = param.data[e]
        if kind != "down_proj":
            inter = dest.shape[0] // 2
            dest = dest.narrow(0, 0 if kind == "gate_proj" else inter, inter)
        if tuple(tensor.shape) != tuple(dest.shape):
            loader.misshaped.append(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(dest.shape)}"
            )
            return
        dest.copy_(tensor.to(dest.dtype))
        if part == "weight":
            seen.setdefault(prefix, set()).add((e, kind))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self, self.stacked_params)
        seen: dict[str, set[tuple[int, str]]] = {}
        for raw_name, tensor in weights:
            name = hf_to_kvserve_name(raw_name)
            if name is None or name.endswith("rotary_emb.inv_freq"):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            m = _EXPERT_RE.match(name)
            if m:
                self._load_expert(loader, m, tensor, seen)
                continue
            loader.load(name, tensor)
        absent: list[str] = []
        for prefix, got in seen.items():
            num = loader.params[f"{prefix}.down_proj"].shape[0]
            for kinds, pname in ((("gate_proj", "up_proj"), "gate_up_proj"), (("down_proj",), "down_proj")):
                want = {(e, k) for e in range(num) for k in kinds}
                if want <= got:  # (the quantized loader yields a kept weight only with its scales)
                    loader.loaded.update((f"{prefix}.{pname}{part}", -1) for part in _EXPERT_PART.values()
                                         if f"{prefix}.{pname}{part}" in loader.params)
                else:
                    absent += [f"{prefix}.{e}.{k}.weight" for e, k in sorted(want - got)]
        if self._tie_if_absent and not any(t == "lm_head.weight" for t, _ in loader.loaded):
            del self.lm_head
            del loader.params["lm_head.weight"]
            self.tie_word_embeddings = True
        if absent:
            raise WeightLoadError(
                f"Checkpoint does not match {type(self).__name__}: missing expert tensors: {absent[:10]}"
            )
        loader.finish()
