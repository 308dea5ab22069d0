"""Triton kernels against the plain-torch ground truth (``kvserve.kernels.reference``).

Store: ``triton_store.store_kv`` is bit-exact with ``reference.store_kv`` (float casts and fp8
``fp8(clamp(x / scale))`` bytes, saturation, ±inf, NaN stays NaN), writes nothing outside its slots,
takes strided key/value views and int32/int64 slot maps.
Attention: ``triton_attention.paged_attention`` equals float64 dense attention over the same
(dequantized) pages, on mixed batches and on decode-only batches with forced split-KV.

On CPU the kernels run in the Triton interpreter (conftest.py sets ``TRITON_INTERPRET=1`` and
patches its down-casts to torch's and its bf16 ``tl.dot``); shapes stay small there, the larger
grid is ``gpu``-marked.
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from kvserve.kernels import reference, triton_attention, triton_store
from kvserve.kernels.reference import CacheQuant
from kvserve.layers.attention import decode_order
from triton_support import kernel_device, skip_without_triton_device

pytestmark = [
    skip_without_triton_device(),
    # numpy in the interpreter warns where fp32 values overflow to inf on purpose (fp16 casts, max / 0.37)
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]
DEV = kernel_device()
ON_GPU = DEV == "cuda"

FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
FLOAT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SCALE_PAIRS = [(1.0, 0.37), (0.37, 3.1), (3.1, 1.0)]  # (k_scale, v_scale): each scale on K and on V


def _gen(*key: object) -> torch.Generator:
    """A generator seeded from the case (stable across runs, unlike ``hash`` of strings)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _quant(cache: str, k_scale: float, v_scale: float) -> CacheQuant | None:
    if cache not in FP8:
        return None
    return CacheQuant(*FP8[cache], k_scale=k_scale, v_scale=v_scale, device=DEV)


def _storage(cache: str) -> torch.dtype:
    return torch.uint8 if cache in FP8 else FLOAT[cache]


def _poisoned_cache(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A cache full of random bytes (any bit pattern, NaNs included)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape).to(DEV)


# ---- store -----------------------------------------------------------------------------------
def _kv_inputs(T: int, hq: int, hk: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """K and V as strided views split out of one [T, (Hq + 2 Hk) * D] qkv tensor. Magnitudes span
    2^-20 .. near the dtype's max (fp8 subnormals, underflow, saturation); ±max and ±inf included."""
    width = (hq + 2 * hk) * d
    top = min(math.log2(torch.finfo(dtype).max) - 3, 18.0)
    mag = torch.exp2(torch.empty(T, width).uniform_(-20.0, top, generator=gen))
    qkv = (torch.randn(T, width, generator=gen) * mag).to(dtype)
    fmax = torch.finfo(dtype).max
    k_cols = slice(hq * d, (hq + hk) * d)
    for i, x in enumerate([math.inf, -math.inf, fmax, -fmax]):
        qkv[i % T, hq * d + (7 * i) % (2 * hk * d)] = x  # in K or V
        qkv[(i + 1) % T, k_cols][(3 * i) % (hk * d)] = x
    qkv = qkv.to(DEV)
    k = qkv[:, hq * d : (hq + hk) * d].view(T, hk, d)
    v = qkv[:, (hq + hk) * d :].view(T, hk, d)
    assert not k.is_contiguous() and not v.is_contiguous()
    return k, v


def _slots(T: int, num_blocks: int, block_size: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Distinct random slots over shuffled blocks, with padding (-1) interleaved and at the end."""
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[1::4] = -1
    slots[-1] = -1
    return slots.to(dtype).to(DEV)


def _written_rows(slots: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """[num_blocks, 2, block_size] bool: the cache rows a store to ``slots`` may touch."""
    mask = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    s = slots.cpu().long()
    mask[s[s >= 0]] = True
    return mask.view(num_blocks, 1, block_size).expand(num_blocks, 2, block_size)


def _bits(c: torch.Tensor) -> torch.Tensor:
    """The cache as same-size integers, [num_blocks, 2, block_size, Hk * D]."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[c.element_size()]
    return c.view(as_int).flatten(3)


def _check_store(k, v, slots, cache_shape, cache: str, quant, gen, nan_positions=None, store=None) -> None:
    """Store with both implementations into identically poisoned caches and compare bits."""
    ours = _poisoned_cache(cache_shape, _storage(cache), gen)
    poison = ours.clone()
    expected = ours.clone()
    n = slots.shape[0]  # the reference takes int64 slots, one per key row
    reference.store_kv(k[:n], v[:n], expected, slots.long(), quant)
    (store or triton_store.store_kv)(k, v, ours, slots, quant)
    rows = _written_rows(slots, cache_shape[0], cache_shape[2]).to(DEV)
    ob, eb, pb = _bits(ours), _bits(expected), _bits(poison)
    assert torch.equal(ob[~rows], pb[~rows]), "bits outside the stored slots changed"
    if nan_positions is None:
        assert torch.equal(ob, eb), f"{int((ob != eb).sum())} values differ from reference.store_kv"
        return
    nan = nan_positions.reshape(ob.shape)
    assert torch.equal(ob[~nan], eb[~nan])
    got = (ours.view(quant.fp8_dtype) if quant is not None else ours).flatten(3)
    assert bool(got[nan].float().isnan().all()), "NaN did not stay NaN"


STORE_SHAPES = [(1, 64, 16), (2, 128, 32), (8, 64, 32), (8, 128, 16), (3, 64, 16)]  # (Hk, D, block_size)


@pytest.mark.parametrize("cache", ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("in_dtype", ["bf16", "fp16", "fp32"])
def test_store_bit_exact(in_dtype, cache):
    """Every shape, and for fp8 every scale on K and on V; strided K/V; -1 slots; poisoned cache."""
    gen = _gen("store", in_dtype, cache)
    for i, (hk, d, bs) in enumerate(STORE_SHAPES):
        k_scale, v_scale = SCALE_PAIRS[i % len(SCALE_PAIRS)]
        T, num_blocks = 24, 5
        k, v = _kv_inputs(T, 2 * hk, hk, d, FLOAT[in_dtype], gen)
        slots = _slots(T, num_blocks, bs, gen, torch.int32 if i % 2 else torch.int64)
        _check_store(k, v, slots, (num_blocks, 2, bs, hk, d), cache, _quant(cache, k_scale, v_scale), gen)


@pytest.mark.parametrize("cache", ["bf16", "fp32", "fp8_e4m3", "fp8_e5m2"])
def test_store_nan_stays_nan(cache):
    gen = _gen("nan", cache)
    T, hk, d, bs, num_blocks = 16, 2, 64, 16, 3
    k, v = _kv_inputs(T, 2, hk, d, torch.bfloat16, gen)
    nan_k = torch.rand(k.shape, generator=gen) < 0.1
    nan_v = torch.rand(v.shape, generator=gen) < 0.1
    k[nan_k.to(DEV)] = math.nan
    v[nan_v.to(DEV)] = -math.nan
    slots = _slots(T, num_blocks, bs, gen, torch.int64)
    # where the NaNs land: [num_blocks, 2, block_size, Hk, D]
    where = torch.zeros(num_blocks * bs, 2, hk, d, dtype=torch.bool)
    s = slots.cpu()
    valid = s >= 0
    where[s[valid], 0] = nan_k[valid]
    where[s[valid], 1] = nan_v[valid]
    where = where.view(num_blocks, bs, 2, hk, d).transpose(1, 2).to(DEV)
    assert bool(where.any())
    _check_store(k, v, slots, (num_blocks, 2, bs, hk, d), cache, _quant(cache, 0.37, 3.1), gen, where)


@pytest.mark.parametrize("cache", ["bf16", "fp8_e4m3"])
def test_store_fewer_slots_than_tokens(cache):
    """vLLM: the token count is the slot map's length; rows of key/value past it are not stored."""
    gen = _gen("short", cache)
    T, hk, d, bs, num_blocks = 20, 2, 128, 16, 4
    k, v = _kv_inputs(T, 4, hk, d, torch.bfloat16, gen)
    slots = _slots(13, num_blocks, bs, gen, torch.int32)
    _check_store(k, v, slots, (num_blocks, 2, bs, hk, d), cache, _quant(cache, 0.37, 1.0), gen)


def test_store_empty_and_all_padding():
    gen = _gen("empty")
    k, v = _kv_inputs(6, 2, 1, 64, torch.float32, gen)
    for slots in (torch.empty(0, dtype=torch.int64, device=DEV), torch.full((6,), -1, device=DEV)):
        _check_store(k, v, slots, (2, 2, 16, 1, 64), "fp8_e4m3", _quant("fp8_e4m3", 3.1, 0.37), gen)



# Several tokens per program: (Hk, D, block_size, num_warps or None); Hk = 3 pads the head tile,
# D = 96 the head, (8, 256) with 16 tokens splits the heads into two groups of 4.
MULTI_TOKEN_SHAPES = [(2, 64, 16, None), (3, 64, 16, 2), (8, 128, 16, None), (1, 96, 32, 4), (8, 256, 16, None)]


def _program_slots(n: int, per_program: int, num_blocks: int, block_size: int, gen: torch.Generator, dtype) -> torch.Tensor:
    """Distinct random slots, never slot 0 (where a masked-out token's address would point), with
    -1 interleaved, one whole program's tokens -1 (the second) and the last token -1."""
    slots = torch.randperm(num_blocks * block_size - 1, generator=gen)[:n] + 1
    slots[2::3] = -1
    slots[per_program : 2 * per_program] = -1
    slots[-1] = -1
    return slots.to(dtype).to(DEV)


@pytest.mark.parametrize("cache", ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("per_program", [1, 2, 4, 8])
def test_store_tokens_per_program(per_program, cache):
    """Forced tokens per program: token counts that are no multiple of it, more key rows than slots,
    -1 slots (one program all -1), every input dtype; bit-exact, nothing else touched."""
    gen = _gen("per-program", per_program, cache)
    for i, (hk, d, bs, warps) in enumerate(MULTI_TOKEN_SHAPES):
        k_scale, v_scale = SCALE_PAIRS[i % len(SCALE_PAIRS)]
        in_dtype = FLOAT[["bf16", "fp16", "fp32"][i % 3]]
        n = 4 * per_program + per_program // 2 + 1  # a partial last program (per_program > 1)
        num_blocks = triton_store.triton.cdiv(n + 1, bs) + 2
        k, v = _kv_inputs(n + 3, 2 * hk, hk, d, in_dtype, gen)
        slots = _program_slots(n, per_program, num_blocks, bs, gen, torch.int32 if i % 2 else torch.int64)
        assert (slots.cpu() >= 0).any()
        ours = functools.partial(triton_store.store_kv, tokens_per_program=per_program, num_warps=warps)
        _check_store(k, v, slots, (num_blocks, 2, bs, hk, d), cache, _quant(cache, k_scale, v_scale), gen, store=ours)


@pytest.mark.parametrize("cache", ["bf16", "fp8_e4m3"])
def test_store_auto_several_tokens(cache, monkeypatch):
    """Small heads, few multiprocessors: the automatic choice takes 8 tokens per program; bit-exact."""
    monkeypatch.setattr(triton_store, "num_sms", lambda device: 1)
    gen = _gen("auto-multi", cache)
    n, hk, d, bs, num_blocks = 50, 2, 64, 16, 5
    assert triton_store.store_plan(n, hk, d, 2, num_sms=1)[0] == 8
    k, v = _kv_inputs(n, 2 * hk, hk, d, torch.bfloat16, gen)
    slots = _program_slots(n, 8, num_blocks, bs, gen, torch.int64)
    _check_store(k, v, slots, (num_blocks, 2, bs, hk, d), cache, _quant(cache, 3.1, 0.37), gen)


def test_store_plan():
    """The automatic tiling: ~4 KB of K + V per program (several tokens only for small heads), fewer
    tokens per program while the grid would leave multiprocessors short, ~16 elements per thread,
    head groups for large heads or large forced programs."""
    plan = triton_store.store_plan
    assert plan(65536, 8, 128, 2, num_sms=132) == (1, 8, 128, 2)  # 4 KB of bf16 K + V per token
    assert plan(65536, 8, 128, 4, num_sms=132) == (1, 8, 128, 2)
    assert plan(65536, 2, 64, 2, num_sms=132) == (8, 2, 64, 2)  # 512 B per token: 8 tokens
    assert plan(65536, 3, 64, 2, num_sms=132) == (4, 4, 64, 2)  # 3 heads pad to 4
    assert plan(2048, 2, 64, 2, num_sms=132)[0] == 2  # 1024 programs >= 4 x 132 (4 tokens: 512)
    assert plan(7, 2, 64, 2, num_sms=132)[0] == 1
    assert plan(65536, 64, 128, 2, num_sms=132) == (1, 32, 128, 8)  # 4096-element token tiles: two head groups
    assert plan(65536, 8, 256, 2, tokens_per_program=16)[:3] == (16, 4, 256)  # program tile capped: head groups
    assert plan(10, 8, 128, 2, tokens_per_program=2, num_warps=2) == (2, 8, 128, 2)
    for bad in ({"tokens_per_program": 3}, {"num_warps": 6}):
        with pytest.raises(ValueError):
            plan(10, 8, 128, 2, **bad)


# Every input dtype x every cache dtype once, the shapes cycled (each case compiles a kernel).
_STORE_SHAPES = [(8, 128, 16), (8, 256, 32), (4, 96, 16), (16, 128, 32)]
STORE_GPU_CASES = [
    (in_dtype, *_STORE_SHAPES[i % len(_STORE_SHAPES)], cache)
    for i, (in_dtype, cache) in enumerate(
        (a, c) for a in ["bf16", "fp16", "fp32"] for c in ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"]
    )
]


@pytest.mark.parametrize("in_dtype,hk,d,bs,cache", STORE_GPU_CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_store_bit_exact_gpu(in_dtype, hk, d, bs, cache):
    gen = _gen("store-gpu", in_dtype, hk, d, bs, cache)
    T, num_blocks = 2048, 256
    for k_scale, v_scale in SCALE_PAIRS if cache in FP8 else [(1.0, 1.0)]:
        k, v = _kv_inputs(T, hk, hk, d, FLOAT[in_dtype], gen)
        slots = _slots(T, num_blocks, bs, gen, torch.int64 if d % 3 else torch.int32)
        _check_store(k, v, slots, (num_blocks, 2, bs, hk, d), cache, _quant(cache, k_scale, v_scale), gen)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("cache", ["bf16", "fp8_e4m3"])
def test_store_in_cuda_graph(cache):
    """Captured once, replayed with new K/V, new slots and new scale values: still bit-exact."""
    gen = _gen("graph", cache)
    T, hk, d, bs, num_blocks = 64, 8, 128, 16, 16
    k, v = _kv_inputs(T, 4 * hk, hk, d, torch.bfloat16, gen)
    slots = _slots(T, num_blocks, bs, gen, torch.int64)
    quant = _quant(cache, 0.37, 3.1)
    kv_cache = torch.zeros(num_blocks, 2, bs, hk, d, dtype=_storage(cache), device=DEV)
    triton_store.store_kv(k, v, kv_cache, slots, quant)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_store.store_kv(k, v, kv_cache, slots, quant)
    k2, v2 = _kv_inputs(T, 4 * hk, hk, d, torch.bfloat16, gen)
    k.copy_(k2)
    v.copy_(v2)
    slots.copy_(_slots(T, num_blocks, bs, gen, torch.int64))
    if quant is not None:
        quant.k_scale_t.fill_(3.1)
        quant.v_scale_t.fill_(0.37)
    expected = _poisoned_cache(kv_cache.shape, kv_cache.dtype, gen)
    kv_cache.copy_(expected)
    reference.store_kv(k, v, expected, slots, quant)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))


# ---- attention -------------------------------------------------------------------------------
@dataclass
class Batch:
    """A paged batch: the cache filled through reference.store_kv, plus the kernel's metadata."""

    query: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    quant: CacheQuant | None

    def kernel_args(self) -> dict:
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)  # noqa: E731
        return dict(
            block_tables=self.block_tables, query_start_loc=as_i32(starts), seq_lens=as_i32(self.seq_lens),
            max_query_len=max(self.query_lens), max_seq_len=max(self.seq_lens),
        )


def _make_batch(
    query_lens: list[int], seq_lens: list[int], hq: int, hk: int, d: int, bs: int, q_dtype: torch.dtype,
    cache: str, gen: torch.Generator, strided_query: bool = False,
) -> Batch:
    """Random K/V for every position stored at shuffled blocks (block 0 is a never-written
    NaN-poisoned null block that pads the tables; unwritten slot tails are NaN too)."""
    quant = _quant(cache, 0.37, 3.1)
    need = [-(-n // bs) for n in seq_lens]
    num_blocks = 1 + sum(need) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seq_lens), max(need) + 1, dtype=torch.int32)  # one padding column
    poison = 0x7F if quant is not None else math.nan  # 0x7F: NaN in e4m3fn and in e5m2
    kv_cache = torch.full((num_blocks, 2, bs, hk, d), poison, dtype=_storage(cache), device=DEV)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
        pos = torch.arange(seq_lens[i])
        slots = tables[i, pos // bs].long() * bs + pos % bs
        kscale, vscale = (quant.k_scale, quant.v_scale) if quant is not None else (1.0, 1.0)
        k = torch.randn(seq_lens[i], hk, d, generator=gen) * (2.0 * kscale)
        v = torch.randn(seq_lens[i], hk, d, generator=gen) * (2.0 * vscale)
        reference.store_kv(k.to(DEV), v.to(DEV), kv_cache, slots.to(DEV), quant)
    T = sum(query_lens)
    q = torch.randn(T, hq * d, generator=gen) * 1.5
    if strided_query:  # a view split out of a fused qkv projection, as in the model
        q = torch.cat([q, torch.randn(T, 2 * hk * d, generator=gen)], dim=1)
    q = q.to(q_dtype).to(DEV)[:, : hq * d].view(T, hq, d)
    return Batch(q, kv_cache, tables.to(DEV), query_lens, seq_lens, quant)


def _dense_f64(b: Batch, scale: float) -> torch.Tensor:
    """Float64 attention over the dequantized pages: causal, with each chunk's cached context."""
    tables, bs = b.block_tables.long(), b.kv_cache.shape[2]
    hq, hk = b.query.shape[1], b.kv_cache.shape[3]

    def read(blk: torch.Tensor, off: torch.Tensor, kv: int) -> torch.Tensor:  # [L, Hq, D] float64
        rows = b.kv_cache[blk, kv, off]
        if b.quant is not None:
            rows = rows.view(b.quant.fp8_dtype).double() * (b.quant.v_scale if kv else b.quant.k_scale)
        return rows.double().repeat_interleave(hq // hk, dim=1)

    out, start = [], 0
    for i, (n, L) in enumerate(zip(b.query_lens, b.seq_lens)):
        pos = torch.arange(L, device=DEV)
        blk, off = tables[i, pos // bs], pos % bs
        k, v = read(blk, off, 0), read(blk, off, 1)
        s = torch.einsum("qhd,khd->hqk", b.query[start : start + n].double(), k) * scale
        allowed = pos[None, :] <= torch.arange(L - n, L, device=DEV)[:, None]
        p = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", p, v))
        start += n
    return torch.cat(out)


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def _check_attention(b: Batch, num_splits: int | None = None, pass_out: bool = True, **kernel_kw) -> None:
    scale = b.query.shape[-1] ** -0.5
    expected = _dense_f64(b, scale)
    # the ground truth agrees with itself (reference backend vs float64 dense)
    ref = reference.paged_attention(b.query, b.kv_cache, b.block_tables, b.query_lens, b.seq_lens, scale, quant=b.quant)
    fp32 = b.query.dtype == torch.float32 and b.kv_cache.dtype == torch.float32
    tol = 1e-4 if fp32 else 2e-2
    assert _rel_err(ref, expected) <= tol / 4
    out = torch.full(b.query.shape, math.nan, dtype=b.query.dtype, device=DEV) if pass_out else None
    got = triton_attention.paged_attention(
        b.query, b.kv_cache, scale=scale, quant=b.quant, out=out, num_splits=num_splits, **b.kernel_args(), **kernel_kw
    )
    assert got.shape == b.query.shape and got.dtype == b.query.dtype and got.device == b.query.device
    if out is not None:
        assert got.data_ptr() == out.data_ptr(), "out= was not written in place"
    assert bool(torch.isfinite(got).all()), "rows left unwritten or poisoned pages read"
    err = _rel_err(got, expected)
    assert err <= tol, f"relative Frobenius error {err:.2e} > {tol:.0e}"


# Mixed batch on CPU: decodes (one with a single-token context), a prefill chunk over cached
# context, a fresh prefill, and a last chunk; sequences interleaved, 27 query tokens, contexts <= 70.
MIXED_QLENS = [1, 7, 1, 12, 1, 5]
MIXED_SEQLENS = [17, 40, 1, 12, 45, 70]

# (Hq, Hk, D, block_size, query dtype, cache): GQA 1/2/3/4, D 64/128, bs 16/32, every cache dtype
CPU_CASES = [
    (2, 2, 64, 16, "fp32", "fp32"),
    (4, 2, 128, 32, "fp32", "fp32"),
    (4, 1, 64, 32, "bf16", "bf16"),
    (4, 2, 64, 16, "bf16", "fp8_e4m3"),
    (2, 2, 128, 16, "fp32", "fp8_e5m2"),
    (4, 1, 128, 16, "bf16", "fp32"),
    (4, 2, 64, 32, "fp32", "fp8_e4m3"),
    (2, 2, 64, 32, "bf16", "fp8_e5m2"),
    (6, 2, 64, 16, "bf16", "fp8_e4m3"),  # GQA 3 (SmolLM2: 9 / 3): a group that is not a power of two
    (3, 1, 128, 32, "fp32", "fp32"),
]


def _case_id(c: tuple) -> str:
    hq, hk, d, bs, qd, cache = c
    return f"h{hq}-{hk}-d{d}-bs{bs}-q{qd}-{cache}"


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_attention_mixed_batch(case):
    hq, hk, d, bs, qd, cache = case
    gen = _gen("mixed", case)
    strided = CPU_CASES.index(case) % 2 == 1
    b = _make_batch(MIXED_QLENS, MIXED_SEQLENS, hq, hk, d, bs, FLOAT[qd], cache, gen, strided_query=strided)
    # every third case launches its query blocks last-first (HEAVY_FIRST): the same rows, another order
    _check_attention(b, pass_out=CPU_CASES.index(case) != 2, heavy_first=CPU_CASES.index(case) % 3 == 0)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize(
    "case", [(8, 2, 128, 16, "bf16", "fp8_e4m3"), (4, 2, 64, 32, "fp32", "fp32")], ids=_case_id
)
def test_attention_decode_only(case, num_splits):
    """Decode-only batch, automatic or forced split-KV; context 1 leaves some splits empty."""
    hq, hk, d, bs, qd, cache = case
    gen = _gen("decode", case, num_splits)
    seq_lens = [33, 1, 97, 64]
    b = _make_batch([1] * len(seq_lens), seq_lens, hq, hk, d, bs, FLOAT[qd], cache, gen)
    _check_attention(b, num_splits=num_splits)
    # launched longest first (the runner's order): every sequence still gets its own rows
    _check_attention(b, num_splits=num_splits, order=_order(seq_lens))


# (Hq, Hk, D, block size, query dtype, cache): both decodes of fp8 pages across G 1 / 3 / 4 / 6,
# heads 64 / 96 (padded to 128) / 128 / 256, e4m3 and e5m2, bf16 and fp16 queries
PAIRED_CASES = [
    (8, 2, 128, 16, "bf16", "fp8_e4m3"),
    (4, 4, 64, 32, "fp16", "fp8_e5m2"),
    (6, 2, 96, 16, "bf16", "fp8_e4m3"),
    (12, 2, 256, 16, "bf16", "fp8_e5m2"),
]


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("case", PAIRED_CASES, ids=_case_id)
def test_paired_and_unpaired_decode_match_the_reference(case, num_splits):
    """fp8 pages' decode with the pages read in 16-bit words (``paired``, the default) and a byte at
    a time (``paired=False``), the dequantizing read: the reference's rows, batch order and longest
    first, split or not."""
    hq, hk, d, bs, qd, cache = case
    gen = _gen("paired", case, num_splits)
    seq_lens = [33, 1, 97, 64, 300]
    b = _make_batch([1] * len(seq_lens), seq_lens, hq, hk, d, bs, FLOAT[qd], cache, gen)
    for paired in (True, False):
        _check_attention(b, num_splits=num_splits, paired=paired)
        _check_attention(b, num_splits=num_splits, order=_order(seq_lens), paired=paired)


def _order(seq_lens: list[int]) -> torch.Tensor:
    order = decode_order(seq_lens)
    assert sorted(order) == list(range(len(seq_lens))) and order != list(range(len(seq_lens)))
    return torch.tensor(order, dtype=torch.int32, device=DEV)


def test_decode_order_is_longest_first_and_stable():
    assert decode_order([5, 9, 5, 1, 9]) == [1, 4, 0, 2, 3]
    assert decode_order([]) == []


def test_decode_programs_follow_the_order():
    """The kernel reads ``order``: every program pointed at sequence 2 computes its rows only, the
    other rows stay poisoned."""
    case = (4, 2, 64, 16, "bf16", "bf16")
    b = _make_batch([1] * 4, [33, 1, 97, 64], *case[:4], torch.bfloat16, "bf16", _gen("order", case))
    out = torch.full(b.query.shape, math.nan, dtype=b.query.dtype, device=DEV)
    order = torch.full((4,), 2, dtype=torch.int32, device=DEV)
    triton_attention.paged_attention(b.query, b.kv_cache, scale=0.125, out=out, order=order, **b.kernel_args())
    assert bool(out[[0, 1, 3]].isnan().all())
    want = reference.paged_attention(b.query, b.kv_cache, b.block_tables, b.query_lens, b.seq_lens, 0.125)
    assert _rel_err(out[2], want[2].double()) < 2e-2


@pytest.mark.parametrize("case", [(4, 2, 64, 16, "bf16", "bf16"), (4, 2, 64, 16, "bf16", "fp8_e4m3"),
                                  (2, 2, 64, 32, "fp32", "fp32")], ids=_case_id)
def test_attention_at_tile_boundaries(case):
    """Lengths just below, at and above the key-tile sizes (64 / 128): the kernel skips masks on
    tiles before a block's first query token, so a tile counted unmasked one key too far shows
    here (a poisoned slot, a wrong key or a key past the query)."""
    hq, hk, d, bs, qd, cache = case
    gen = _gen("tiles", case)
    qlens = [1, 1, 1, 1, 1, 1, 1, 3, 9, 2, 1]
    slens = [63, 64, 65, 120, 127, 128, 129, 66, 136, 257, 255]
    b = _make_batch(qlens, slens, hq, hk, d, bs, FLOAT[qd], cache, gen)
    _check_attention(b)
    _check_attention(_make_batch([1] * 6, [63, 64, 65, 127, 128, 129], hq, hk, d, bs, FLOAT[qd], cache, gen), num_splits=2)


# Chunks longer than a program's BLOCK_Q = BLOCK_M // G tokens (21 at G = 3, 10 at G = 6 with 64
# rows): several query blocks per sequence whose token count is not a power of two, with decodes
# and a chunk over cached context between them.
SPANNING_QLENS = [45, 1, 64, 22, 1, 10]
SPANNING_SEQLENS = [45, 30, 100, 22, 7, 31]


@pytest.mark.parametrize("case", [(6, 2, 64, 16, "bf16", "bf16"), (12, 2, 64, 16, "fp32", "fp8_e4m3"),
                                  (3, 1, 128, 32, "fp32", "fp32")], ids=_case_id)
def test_attention_chunks_span_query_blocks_of_a_group_not_a_power_of_two(case):
    hq, hk, d, bs, qd, cache = case
    b = _make_batch(SPANNING_QLENS, SPANNING_SEQLENS, hq, hk, d, bs, FLOAT[qd], cache, _gen("spanning", case))
    _check_attention(b, heavy_first=hq == 12)


# ---- attention, GPU grid ---------------------------------------------------------------------
GPU_GQA = [(8, 8), (8, 4), (9, 3), (8, 2), (32, 8)]
GPU_CACHES = ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"]


def _gpu_batch(gen: torch.Generator) -> tuple[list[int], list[int]]:
    """~40 decodes with contexts up to 2000, chunks over cached context, fresh prefills."""
    qlens, slens = [], []
    for _ in range(40):
        qlens.append(1)
        slens.append(int(torch.randint(1, 2000, (1,), generator=gen)))
    for n, ctx in [(256, 700), (37, 1500), (512, 0), (3, 30), (130, 0)]:
        qlens.append(n)
        slens.append(n + ctx)
    order = torch.randperm(len(qlens), generator=gen).tolist()
    return [qlens[i] for i in order], [slens[i] for i in order]


# Every cache dtype x every head size once, the GQA shapes cycled (each case compiles kernels).
MIXED_GPU_CASES = [
    (*GPU_GQA[i % len(GPU_GQA)], d, cache)
    for i, (d, cache) in enumerate((d, c) for d in (64, 128, 256) for c in GPU_CACHES)
]


@pytest.mark.parametrize("hq,hk,d,cache", MIXED_GPU_CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_attention_mixed_batch_gpu(hq, hk, d, cache):
    """Block size and query dtype vary with the case (bf16/fp8 caches take every query dtype)."""
    bs = 16 if (d // 64 + hk + GPU_CACHES.index(cache)) % 2 else 32
    qd = {"fp16": "fp16", "fp32": "fp32"}.get(cache, ["bf16", "fp16", "fp32"][(d // 64 + hk) % 3])
    gen = _gen("mixed-gpu", hq, hk, d, cache)
    qlens, slens = _gpu_batch(gen)
    b = _make_batch(qlens, slens, hq, hk, d, bs, FLOAT[qd], cache, gen, strided_query=hk != 4)
    _check_attention(b, heavy_first=MIXED_GPU_CASES.index((hq, hk, d, cache)) % 2 == 0)


DECODE_GPU_CASES = [
    (d, cache, [None, 3, 16][i % 3])
    for i, (d, cache) in enumerate((d, c) for d in (64, 128, 256) for c in ["bf16", "fp32", "fp8_e4m3", "fp8_e5m2"])
]


@pytest.mark.parametrize("d,cache,num_splits", DECODE_GPU_CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_attention_decode_only_gpu(d, cache, num_splits):
    gen = _gen("decode-gpu", d, cache, num_splits)
    seq_lens = [1, 2, 15, 16, 17] + torch.randint(1, 4000, (59,), generator=gen).tolist()
    qd = "fp32" if cache == "fp32" else "bf16"
    b = _make_batch([1] * len(seq_lens), seq_lens, 32, 8, d, 16, FLOAT[qd], cache, gen)
    order = _order(seq_lens) if d == 128 else None
    _check_attention(b, num_splits=num_splits, order=order)  # fp8 pages: the paired decode (its PTX runs only here)
    if cache.startswith("fp8"):  # and the unpaired one
        _check_attention(b, num_splits=num_splits, order=order, paired=False)


@pytest.mark.parametrize("q_mag", [3e4, 1e-5])
@pytest.mark.parametrize("cache", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pages_with_queries_beyond_fp16_range(cache, q_mag):
    """fp8 pages are read in fp16 with the query rescaled by a power of two: bf16 queries far
    above fp16's max (65504 after the dot's growth) or deep in its subnormals still match."""
    gen = _gen("qrange", cache, q_mag)
    b = _make_batch(MIXED_QLENS, MIXED_SEQLENS, 4, 2, 64, 16, torch.bfloat16, cache, gen)
    b.query.mul_(q_mag)
    assert bool(torch.isfinite(b.query).all())
    if q_mag > 1:
        assert float(b.query.float().abs().max()) > 65504  # would overflow fp16 as it is
    _check_attention(b)
