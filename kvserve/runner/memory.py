"""KV memory planner: bytes per page for the cache dtype, and how many pages the budget holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.config import CacheConfig, ModelConfig
from kvserve.engine.state_cache import snapshot_interval_tokens
from kvserve.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer: K and V, block_size tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all attention layers (what one block id costs)."""
        return self.page_bytes * self.num_layers


def kv_cache_torch_dtype(cache_config: CacheConfig, model_config: ModelConfig) -> torch.dtype:
    """The cache tensor's dtype: the resolved float dtype, or uint8 bytes for fp8."""
    if cache_config.kv_dtype is not None:
        return cache_config.kv_dtype.storage_dtype
    name = cache_config.cache_dtype
    if name == "auto":
        return model_config.dtype
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def plan_num_blocks(spec: KVCacheSpec, budget_bytes: int, max_model_len: int, override: int | None = None) -> int:
    """Blocks that fit the budget; errors when one max_model_len request would not fit."""
    num_blocks = override if override is not None else budget_bytes // spec.block_bytes
    needed = -(-max_model_len // spec.block_size)
    if num_blocks < needed:
        gib = 1 << 30
        est_len = num_blocks * spec.block_size
        raise ValueError(
            f"To serve at least one request with the models's max seq len ({max_model_len}), "
            f"({needed * spec.block_bytes / gib:.2f} GiB KV cache is needed, which is larger than "
            f"the available KV cache memory ({budget_bytes / gib:.2f} GiB). Based on the available "
            f"memory, the estimated maximum model length is {est_len}. Try increasing "
            "`kv_cache_memory` (`gpu_memory_utilization` on GPU) or decreasing `max_model_len` "
            "when initializing the engine."
        )
    return num_blocks


def gpu_kv_budget(gpu_memory_utilization: float, peak_activation_bytes: int, device: torch.device) -> int:
    """vLLM's rule: utilization x total memory, minus what is in use now, minus the activation peak."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return int(total * gpu_memory_utilization - used - peak_activation_bytes)


def log_plan(
    spec: KVCacheSpec, num_blocks: int, max_model_len: int, device: torch.device, dtype_name: str | None = None
) -> None:
    tokens = num_blocks * spec.block_size
    where = "GPU" if device.type == "cuda" else "CPU"
    logger.info(
        "KV cache: dtype=%s, %d layers x %d kv heads x head %d, block_size=%d -> %d bytes per block "
        "(%d per layer page), %d blocks (%.2f GiB)",
        dtype_name or str(spec.dtype).replace("torch.", ""), spec.num_layers, spec.num_kv_heads, spec.head_size,
        spec.block_size, spec.block_bytes, spec.page_bytes, num_blocks, num_blocks * spec.block_bytes / (1 << 30),
    )
    logger.info("%s KV cache size: %s tokens", where, f"{tokens:,}")
    logger.info(
        "Maximum concurrency for %s tokens per request: %.2fx", f"{max_model_len:,}", tokens / max_model_len
    )


def snapshot_interval(spec: KVCacheSpec, state_bytes_per_layer: int, override: int | None) -> int:
    """Tokens between recurrent-state snapshots (hybrid prefix caching): ``--mamba-block-size``, else
    vLLM's hit granularity, the smallest multiple of the block size whose attention page (one layer)
    holds at least one GDN layer's state (784 tokens on Qwen3.6-27B with bf16 KV, 1,568 with fp8)."""
    if override is not None:
        if override <= 0 or override % spec.block_size:
            raise ValueError(
                f"mamba_block_size ({override}) must be a positive multiple of block_size ({spec.block_size})."
            )
        return override
    return snapshot_interval_tokens(state_bytes_per_layer, spec.page_bytes // spec.block_size, spec.block_size)


def num_state_slots(max_num_seqs: int, bytes_per_sequence: int, budget_bytes: int) -> int:
    """Live recurrent-state slots on the GPU: one per sequence up to ``max_num_seqs``, in at most
    half of the memory budget; fewer (with a warning: max_num_seqs is lowered to match) when the
    states of ``max_num_seqs`` sequences do not fit, e.g. the 27B (147 MiB each) at vLLM's default
    of 1,024 sequences on an H200."""
    fit = budget_bytes // 2 // max(1, bytes_per_sequence)
    if fit < 1:
        raise ValueError(
            f"The recurrent state of one sequence ({bytes_per_sequence / (1 << 20):.1f} MiB) does not fit in half "
            f"of the memory left for caches ({max(budget_bytes, 0) / (1 << 30):.2f} GiB). Try increasing "
            "`gpu_memory_utilization`."
        )
    if fit >= max_num_seqs:
        return max_num_seqs
    logger.warning(
        "max_num_seqs lowered from %d to %d: the recurrent states of %d sequences (%.2f GiB) are what fits in "
        "half of the %.2f GiB left for caches.",
        max_num_seqs, fit, fit, fit * bytes_per_sequence / (1 << 30), budget_bytes / (1 << 30),
    )
    return fit


def num_snapshot_slots(max_num_seqs: int, bytes_per_sequence: int, budget_bytes: int | None) -> int:
    """Snapshot slots for hybrid prefix caching: one per running sequence, at most a quarter of the
    memory budget left after the live states (GPU); 0 when not even one fits."""
    if budget_bytes is None:
        return max_num_seqs
    return max(0, min(max_num_seqs, budget_bytes // 4 // max(1, bytes_per_sequence)))


def log_state_pool(specs: list, num_slots: int, device: torch.device, num_snapshots: int = 0,
                   interval: int = 0, num_scratch: int = 0) -> None:
    """The recurrent-state pool of a hybrid model (``runner/state_pool.py``), next to the KV log;
    ``num_scratch``: the row that padded CUDA-graph decode rows write (counted in the total)."""
    per_seq = sum(spec.bytes_per_sequence for spec in specs)
    conv_shapes = sorted({spec.conv_shape for spec in specs})
    ssm_shapes = sorted({spec.ssm_shape for spec in specs})
    scratch = f" + {num_scratch} scratch slot (CUDA-graph padding)" if num_scratch else ""
    logger.info(
        "Recurrent state (%s): %d GDN layers, conv %s + SSM %s float32 per layer -> %.2f MiB per sequence, "
        "%d slots (max_num_seqs)%s = %.2f GiB",
        "GPU" if device.type == "cuda" else "CPU", len(specs), conv_shapes, ssm_shapes, per_seq / (1 << 20),
        num_slots, scratch, (num_slots + num_scratch) * per_seq / (1 << 30),
    )
    if num_snapshots:
        logger.info(
            "Prefix caching for hybrid models: %d state snapshot slots (%.2f GiB), a snapshot every %d tokens",
            num_snapshots, num_snapshots * per_seq / (1 << 30), interval,
        )
