"""FlashInfer's paged decode as a peer of kvserve's decode kernel, on the very pages kvserve reads.

FlashInfer's "NHD" paged layout, [pages, 2, page_size, Hk, D], is kvserve's cache layout, so both
read one pool through one block table (the table's rows become FlashInfer's indptr / indices /
last_page_len). fp8 pages are the same bytes viewed as float8_e4m3fn with the per-tensor k_scale /
v_scale passed to ``run`` (FlashInfer folds k_scale into the softmax scale and multiplies the output
by v_scale). Each point runs both of FlashInfer's decode modes (CUDA cores, and tensor cores: its
prefill kernel with one query token), and a caller keeps the faster one, as the issue's table did.

Needs ``flashinfer-python`` (JIT-compiles each kernel on first use, ~30 s) and a CUDA device.
"""

from __future__ import annotations

import torch

MODES = {"cuda_cores": False, "tensor_cores": True}


def available() -> str | None:
    """None when FlashInfer can run here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # not installed, or an ABI it was not built for
        return f"flashinfer not importable: {type(e).__name__}: {str(e)[:200]}"
    return None


class FlashInferDecode:
    """One workspace, one wrapper per mode; ``plan`` per (batch, context, dtype, mode), then ``run``."""

    def __init__(self, device: torch.device, workspace_mb: int = 128) -> None:
        import flashinfer

        self.version = flashinfer.__version__
        self.workspace = torch.zeros(workspace_mb << 20, dtype=torch.uint8, device=device)
        self.wrappers = {m: flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=tc)
                         for m, tc in MODES.items()}

    def plan(self, mode: str, block_tables: torch.Tensor, context: int, q_heads: int, kv_heads: int, head_dim: int,
             page_size: int, fp8: bool, scale: float) -> None:
        """Every sequence holds ``context`` tokens in the pages of its block-table row."""
        b, nblk = block_tables.shape
        dev = block_tables.device
        indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * nblk
        indices = block_tables.reshape(-1).to(torch.int32).contiguous()
        last = torch.full((b,), context - (nblk - 1) * page_size, dtype=torch.int32, device=dev)
        self.wrappers[mode].plan(indptr, indices, last, q_heads, kv_heads, head_dim, page_size,
                                 pos_encoding_mode="NONE", q_data_type=torch.bfloat16,
                                 kv_data_type=torch.float8_e4m3fn if fp8 else torch.bfloat16, sm_scale=scale)

    def run(self, mode: str, q: torch.Tensor, pool: torch.Tensor, out: torch.Tensor,
            k_scale: float | None = None, v_scale: float | None = None) -> torch.Tensor:
        """``pool``: kvserve's cache, bf16 or uint8 (fp8 codes, read as e4m3 with the scales)."""
        cache = pool.view(torch.float8_e4m3fn) if pool.dtype == torch.uint8 else pool
        return self.wrappers[mode].run(q, cache, k_scale=k_scale, v_scale=v_scale, out=out)
