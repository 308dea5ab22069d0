"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

from typing import Any

from torch import nn

_LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# hybrid Gated DeltaNet + full attention (kvserve/models/qwen3_next.py: HYBRID_ARCHITECTURES)
_HYBRID_ARCHITECTURES = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
_ARCHITECTURES = _LLAMA_ARCHITECTURES + _HYBRID_ARCHITECTURES


def supported_architectures() -> list[str]:
    return list(_ARCHITECTURES)


def is_hybrid_architecture(architecture: str) -> bool:
    """Whether the architecture has Gated DeltaNet layers (per-sequence recurrent state)."""
    return architecture in _HYBRID_ARCHITECTURES


def resolve_architecture(architectures: list[str]) -> str:
    for arch in architectures:
        if arch in _ARCHITECTURES:
            return arch
    raise ValueError(
        f"Model architectures {architectures} are not supported for now. "
        f"Supported architectures: {list(_ARCHITECTURES)}"
    )


def build_model(architecture: str, hf_config: Any) -> nn.Module:
    if architecture not in _ARCHITECTURES:
        resolve_architecture([architecture])
    if architecture in _HYBRID_ARCHITECTURES:
        from kvserve.models.qwen3_next import Qwen3NextForCausalLM

        return Qwen3NextForCausalLM(hf_config, architecture)
    from kvserve.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(hf_config, architecture)
