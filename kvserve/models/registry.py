"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

from typing import Any

from torch import nn

_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def supported_architectures() -> list[str]:
    return list(_ARCHITECTURES)


def resolve_architecture(architectures: list[str]) -> str:
    for arch in architectures:
        if arch in _ARCHITECTURES:
            return arch
    raise ValueError(
        f"Model architectures {architectures} are not supported for now. "
        f"Supported architectures: {list(_ARCHITECTURES)}"
    )


def build_model(architecture: str, hf_config: Any) -> nn.Module:
    from kvserve.models.llama import LlamaForCausalLM

    if architecture not in _ARCHITECTURES:
        resolve_architecture([architecture])
    return LlamaForCausalLM(hf_config, architecture)
