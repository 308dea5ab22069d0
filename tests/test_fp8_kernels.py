"""fp8 store and read of the reference backend.

Store: ``fp8(clamp(x_fp32 / scale, -max, max))`` as uint8 bytes, round to nearest even,
saturating; checked bit for bit against torch's own casts and against an independent
nearest-value search over all 256 codes. Read: paged attention over fp8 pages equals dense
float64 attention over the dequantized keys and values (``float(q) * scale``).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.kernels.reference import CacheQuant, dequantize_fp8, paged_attention, quantize_fp8, store_kv

FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def _decode_table(fmt: str) -> torch.Tensor:
    """Value of every byte 0..255, decoded from the bit layout (not through torch's fp8 casts)."""
    exp_bits, man_bits, bias = (4, 3, 7) if fmt == "e4m3" else (5, 2, 15)
    values = []
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e = (b >> man_bits) & ((1 << exp_bits) - 1)
        m = b & ((1 << man_bits) - 1)
        if fmt == "e4m3" and e == 15 and m == 7:
            values.append(math.nan)
        elif fmt == "e5m2" and e == 31:
            values.append(math.nan if m else sign * math.inf)
        elif e == 0:
            values.append(sign * m * 2.0 ** (1 - bias - man_bits))
        else:
            values.append(sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias))
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_table_matches_torch_view(fmt):
    dtype, _ = FORMATS[fmt]
    table = _decode_table(fmt)
    torch_vals = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    same = (table == torch_vals) | (table.isnan() & torch_vals.isnan())
    assert bool(same.all())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.0048438, 0.181, 3.5])
def test_quantize_equals_torch_cast(fmt, in_dtype, scale):
    """Bit-exact against ``(x.float() / scale).clamp(-max, max).to(fp8)`` on fresh random data."""
    dtype, fmax = FORMATS[fmt]
    g = torch.Generator().manual_seed(hash((fmt, str(in_dtype), scale)) % 2**31)
    x = (torch.randn(4096, generator=g) * torch.logspace(-6, 3, 4096).sqrt()).to(in_dtype)
    ours = quantize_fp8(x, scale, dtype, fmax)
    s = torch.tensor(scale, dtype=torch.float32)
    expected = (x.float() / s).clamp(-fmax, fmax).to(dtype).view(torch.uint8)
    assert ours.dtype == torch.uint8
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_is_round_to_nearest_even_by_search(fmt):
    """Independent check: the nearest code (ties to the even mantissa) found by brute force."""
    dtype, fmax = FORMATS[fmt]
    table = _decode_table(fmt)
    finite = [b for b in range(256) if math.isfinite(table[b])]
    codes = torch.tensor(finite)
    vals = table[codes]
    g = torch.Generator().manual_seed(7)
    # random values plus exact midpoints between neighbouring codes (the tie cases)
    rand = torch.randn(3000, generator=g, dtype=torch.float64) * fmax / 8
    pos = vals[vals > 0].sort().values
    mids = ((pos[1:] + pos[:-1]) / 2)
    x = torch.cat([rand, mids, -mids]).float()
    ours = quantize_fp8(x, 1.0, dtype, fmax)
    xd = x.double()
    dist = (xd[:, None] - vals[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    for i in range(x.numel()):
        candidates = codes[(dist[i] == best[i, 0])].tolist()
        if len(candidates) > 1:  # a tie: the even mantissa (lowest bit 0) wins; +0 over -0
            candidates = [c for c in candidates if c & 1 == 0] or candidates
            if table[candidates[0]] == 0:
                candidates = [0x80 if x[i] < 0 or (x[i] == 0 and math.copysign(1, x[i]) < 0) else 0x00]
        got = int(ours[i])
        assert got in candidates or (table[got] == table[candidates[0]]), (
            f"x={float(x[i])!r}: got byte {got:#x} ({float(table[got])}), expected {candidates}"
        )


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_negative_zero_and_nan(fmt):
    dtype, fmax = FORMATS[fmt]
    table = _decode_table(fmt)
    x = torch.tensor([fmax, fmax * 1.0001, fmax * 4, 1e30, math.inf, -fmax, -1e30, -math.inf, -0.0, 0.0, math.nan])
    q = quantize_fp8(x, 1.0, dtype, fmax)
    decoded = table[q.long()]
    assert decoded[:5].tolist() == [fmax] * 5  # at and beyond the max: saturate, never inf/NaN
    assert decoded[5:8].tolist() == [-fmax] * 3
    assert int(q[8]) == 0x80 and int(q[9]) == 0x00  # -0.0 keeps its sign bit
    assert math.isnan(decoded[10])
    # scaling happens before the clamp: 2 * max / 2 is representable, 2 * max / 1 saturates
    assert table[int(quantize_fp8(torch.tensor([2 * fmax]), 2.0, dtype, fmax)[0])] == fmax
    # round trip of every finite code is exact with scale 1
    codes = torch.tensor([b for b in range(256) if math.isfinite(table[b])], dtype=torch.uint8)
    values = dequantize_fp8(codes, 1.0, dtype)
    assert torch.equal(quantize_fp8(values, 1.0, dtype, fmax), codes)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_float_times_scale(fmt):
    dtype, _ = FORMATS[fmt]
    table = _decode_table(fmt)
    codes = torch.randint(0, 256, (1000,), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    scale = 0.0861745
    got = dequantize_fp8(codes, scale, dtype)
    expected = (table[codes.long()].float() * torch.tensor(scale, dtype=torch.float32))
    same = (got == expected) | (got.isnan() & expected.isnan())
    assert got.dtype == torch.float32 and bool(same.all())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size,kv_heads,head", [(16, 2, 64), (32, 1, 128), (16, 4, 32)])
def test_store_writes_only_valid_slots(fmt, block_size, kv_heads, head):
    dtype, fmax = FORMATS[fmt]
    g = torch.Generator().manual_seed(block_size + head)
    num_blocks = 6
    cache = torch.full((num_blocks, 2, block_size, kv_heads, head), 0x5A, dtype=torch.uint8)
    before = cache.clone()
    n = 20
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[[3, 11]] = -1
    key = torch.randn(n, kv_heads, head, generator=g) * 5
    value = torch.randn(n, kv_heads, head, generator=g)
    quant = CacheQuant(dtype, fmax, k_scale=0.125, v_scale=0.02)
    store_kv(key, value, cache, slots, quant)
    touched = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t in range(n):
        s = int(slots[t])
        if s < 0:
            continue
        b, o = divmod(s, block_size)
        touched[b, o] = True
        assert torch.equal(cache[b, 0, o], quantize_fp8(key[t], 0.125, dtype, fmax))
        assert torch.equal(cache[b, 1, o], quantize_fp8(value[t], 0.02, dtype, fmax))
    untouched = ~touched
    assert torch.equal(cache[untouched[:, None].expand(-1, 2, -1).reshape(num_blocks, 2, block_size)],
                       before[untouched[:, None].expand(-1, 2, -1).reshape(num_blocks, 2, block_size)])


def _dense_reference(q, k, v, scale):
    """float64 causal attention of q [Tq, Hq, D] over k/v [Tk, Hk, D], queries at the end."""
    tq, hq, _ = q.shape
    tk, hk, _ = k.shape
    rep = hq // hk
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    qpos = torch.arange(tk - tq, tk)[:, None]
    mask = torch.arange(tk)[None, :] > qpos
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head,hq,hk,block_size", [(64, 4, 2, 16), (128, 8, 1, 32), (32, 3, 3, 16)])
def test_paged_attention_over_fp8_pages(fmt, q_dtype, head, hq, hk, block_size):
    """Mixed batch (a prefill with cached context, a full prefill, two decodes) over fp8 pages equals
    dense attention over the dequantized K/V; and differs from attention over the unquantized K/V."""
    dtype, fmax = FORMATS[fmt]
    g = torch.Generator().manual_seed(head + hq + block_size)
    quant = CacheQuant(dtype, fmax, k_scale=0.05, v_scale=0.011)
    seq_lens, query_lens = [37, 20, 50, 9], [12, 20, 1, 1]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    cache = torch.zeros(num_blocks, 2, block_size, hk, head, dtype=torch.uint8)
    keys, values = [], []
    for i, n in enumerate(seq_lens):
        k = torch.randn(n, hk, head, generator=g) * 3
        v = torch.randn(n, hk, head, generator=g) * 0.5
        pos = torch.arange(n)
        slots = tables[i][pos // block_size] * block_size + pos % block_size
        store_kv(k, v, cache, slots, quant)
        keys.append(k)
        values.append(v)
    q = (torch.randn(sum(query_lens), hq, head, generator=g)).to(q_dtype)
    out = paged_attention(q, cache, tables, query_lens, seq_lens, head**-0.5, quant=quant)
    assert out.dtype == q_dtype
    start = 0
    for i, (n, s) in enumerate(zip(query_lens, seq_lens)):
        kq = dequantize_fp8(quantize_fp8(keys[i], 0.05, dtype, fmax), 0.05, dtype)
        vq = dequantize_fp8(quantize_fp8(values[i], 0.011, dtype, fmax), 0.011, dtype)
        ref = _dense_reference(q[start : start + n].float(), kq, vq, head**-0.5)
        tol = 1e-5 if q_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[start : start + n].double(), ref, atol=tol, rtol=tol)
        if q_dtype == torch.float32:
            unquantized = _dense_reference(q[start : start + n].float(), keys[i], values[i], head**-0.5)
            assert float((unquantized - ref).abs().max()) > 10 * tol  # the test can tell fp8 apart
        start += n
