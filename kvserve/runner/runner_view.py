"""``RunnerView``: what the start-up helpers (kernel warm-up, decode CUDA-graph capture) read of a
``ModelRunner``, typed as a Protocol so that they do not import the runner that calls them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvserve.config import EngineConfig
    from kvserve.models.causal_lm import CausalLM
    from kvserve.runner.sampler import Sampler
    from kvserve.runner.state_pool import StatePool


class RunnerView(Protocol):
    """The runner's built parts: its config, device, KV block size, model, sampler and (hybrid
    models) recurrent-state pool, with the state row that padded CUDA-graph rows write (None
    without decode graphs)."""

    config: EngineConfig
    device: torch.device
    block_size: int
    model: CausalLM
    sampler: Sampler
    state_pool: StatePool | None
    state_scratch_row: int | None
