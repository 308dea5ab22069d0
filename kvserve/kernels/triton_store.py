"""Triton paged KV store: vLLM's ``reshape_and_cache_flash`` for kvserve's cache layout.

One launch writes K and V of every token into ``kv_cache [num_blocks, 2, block_size, Hk, D]``
(slot ``s`` -> block ``s // block_size``, offset ``s % block_size``; slot -1 writes nothing).
Float caches take a round-to-nearest-even cast; fp8 caches (uint8 bytes) take
``fp8(clamp(float32(x) / scale, -max, max))`` with a correctly rounded division, bit-exact with
``reference.store_kv``. The scales are read on device, so the store is CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from kvserve.kernels.reference import CacheQuant

try:  # importing this module must work wherever triton imports (no GPU needed)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency of the GPU backend only
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

_FP8_FORMAT = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
# Elements of one K (or V) tile per program: Hk * D up to this size is one program per token.
_MAX_TILE = 4096

if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        key_ptr, value_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
        num_kv_heads, head_size,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
        block_size,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        FP8_FORMAT: tl.constexpr, FP8_MAX: tl.constexpr,
    ):
        """Program (t, j): token t's heads [j * BLOCK_H, (j + 1) * BLOCK_H), K and V."""
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        blk = slot // block_size
        off = slot - blk * block_size
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < num_kv_heads) & (d[None, :] < head_size)
        h64 = h.to(tl.int64)
        t64 = t.to(tl.int64)
        k = tl.load(key_ptr + t64 * stride_kt + h64[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
        v = tl.load(value_ptr + t64 * stride_vt + h64[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
        row = cache_ptr + blk * stride_cb + off * stride_cs + h64[:, None] * stride_ch + d[None, :] * stride_cd
        if FP8_FORMAT == 0:
            out_ty = cache_ptr.dtype.element_ty
            if k.dtype != out_ty:  # via fp32: one RNE rounding, as torch casts
                k = k.to(tl.float32).to(out_ty)
                v = v.to(tl.float32).to(out_ty)
            tl.store(row, k, mask=mask)
            tl.store(row + stride_ckv, v, mask=mask)
        else:
            fp8_ty = tl.float8e4nv if FP8_FORMAT == 1 else tl.float8e5
            kq = tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr))  # true division, not x * (1/s)
            vq = tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr))
            # clamp, keeping NaN (GPU min/max would replace it with the bound)
            kq = tl.where(kq != kq, kq, tl.minimum(tl.maximum(kq, -FP8_MAX), FP8_MAX))
            vq = tl.where(vq != vq, vq, tl.minimum(tl.maximum(vq, -FP8_MAX), FP8_MAX))
            tl.store(row, kq.to(fp8_ty, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True), mask=mask)
            tl.store(row + stride_ckv, vq.to(fp8_ty, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: CacheQuant | None = None,
) -> None:
    """Write ``key``/``value`` ([T, Hk, D], any strides) into their slots; as ``reference.store_kv``.

    The token count is ``slot_mapping.shape[0]`` (may be less than T, as in vLLM); slot -1 writes
    nothing. One Triton launch, no host synchronisation."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    num_tokens = slot_mapping.shape[0]
    _, two, block_size, num_kv_heads, head_size = kv_cache.shape
    assert two == 2 and key.dim() == 3 and key.shape == value.shape, (key.shape, value.shape, kv_cache.shape)
    assert key.shape[1:] == (num_kv_heads, head_size) and key.shape[0] >= num_tokens
    if quant is None:
        fp8_format, fp8_max = 0, 0.0
        k_scale = v_scale = slot_mapping  # never read
    else:
        assert kv_cache.dtype == torch.uint8, "an fp8 cache is stored as uint8"
        fp8_format, fp8_max = _FP8_FORMAT[quant.fp8_dtype], float(quant.fp8_max)
        k_scale, v_scale = quant.k_scale_t, quant.v_scale_t
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_size)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE // block_d))
    # 16-byte vectors: one warp moves 32 * 16 B; enough warps to cover the tile once
    elems_per_warp = 32 * max(1, 16 // kv_cache.element_size())
    num_warps = max(1, min(8, block_h * block_d // elems_per_warp))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        key, value, kv_cache, slot_mapping, k_scale, v_scale,
        num_kv_heads, head_size,
        *key.stride(), *value.stride(), *kv_cache.stride(),
        block_size,
        BLOCK_H=block_h, BLOCK_D=block_d, FP8_FORMAT=fp8_format, FP8_MAX=fp8_max,
        num_warps=num_warps,
    )
