"""The Gluon W4A16 kernel (kernels/gluon_w4a16.py) for decode batches. On a GPU: against float64 on
fresh random weights quantized by the reference codec (the bound of tests/test_triton_w4a16.py: the
kernel multiplies by ``e2m1 * s_b * s2`` exactly, fp32 accumulation, one rounding), outputs poisoned
with NaN first, several shapes (the 27B's MLP shapes, K not a multiple of 128, N and M not of the
tile), bf16 and fp16, every batch tile, stream-K splits (the same bits twice, the tile counters left
at zero), inside a CUDA graph, and the dispatch (``w4a16_linear``). On the CPU: the kernel compiles
for sm_90 with the installed triton (Gluon is experimental: its API moves between releases)."""

from __future__ import annotations

import pytest
import torch

from test_triton_w4a16 import _bound_ok, _exact, _quantized

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="the Gluon kernel runs on CUDA only (no interpreter)")
SHAPES = [(1, 48, 128), (5, 96, 320), (16, 130, 208), (33, 64, 96), (64, 200, 384), (3, 17408, 5120),
          (16, 5120, 17408), (32, 34816, 5120), (200, 130, 256)]  # (M, N, K)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gluon_w4a16_against_float64(dtype, shape):
    from kvserve.kernels import gluon_w4a16 as g
    from kvserve.kernels.triton_w4a16 import pack_w4a16

    m, n, k = shape
    (packed, block_scale, s2), gen = _quantized(n, k, m * 7919 + n * 31 + k)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    wt = pack_w4a16(packed.cuda(), block_scale.cuda(), s2.cuda())
    y = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    g.w4a16_mma_matmul(x.cuda(), wt, y)
    assert not bool(torch.isnan(y).any())
    assert _bound_ok(y.cpu(), x, _exact(packed, block_scale, s2))


def _tiles_ok(m: int, n: int, k: int, seed: int, dtype: torch.dtype, tiles) -> tuple:
    """One launch of ``tiles`` on fresh quantized weights (output poisoned with NaN): within the
    float64 bound, the same bits on a second call, the tile counters back at zero; returns the
    GPU x, the packed weight and y."""
    from kvserve.kernels import gluon_w4a16 as g
    from kvserve.kernels import triton_w4a16 as tw

    (packed, block_scale, s2), gen = _quantized(n, k, seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    wt = tw.pack_w4a16(packed.cuda(), block_scale.cuda(), s2.cuda())
    y = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    g.w4a16_mma_matmul(x.cuda(), wt, y, tiles)
    assert _bound_ok(y.cpu(), x, _exact(packed, block_scale, s2))
    again = g.w4a16_mma_matmul(x.cuda(), wt, torch.empty_like(y), tiles)
    assert torch.equal(again, y)
    assert not bool(tw._tile_locks(y.device).any())
    return x.cuda(), wt, y


@gpu
@pytest.mark.parametrize("tiles", [(64, 8, 4, 1, 1, False, None), (128, 16, 4, 2, 2, True, None),
                                   (256, 8, 8, None, 3, False, None), (32, 32, 2, 3, 1, True, None),
                                   (64, 64, 4, 1, 2, True, None), (16, 8, 1, 5, 3, True, None),
                                   (64, 8, 4, None, 2, False, 0), (16, 8, 1, None, 3, False, 3),
                                   (32, 16, 2, None, 2, False, 1), (16, 32, 1, None, 2, False, 40),
                                   (64, 8, 4, None, 1, False, 0), (128, 16, 4, 2, 1, True, None, 2),
                                   (128, 32, 4, None, 2, True, None, 2), (32, 16, 2, 3, 3, True, 0, 4),
                                   (128, 32, 4, None, 2, True, 2, 3)],
                         ids=lambda t: "x".join(map(str, t)))
def test_gluon_w4a16_tiles_and_stream_k(tiles):
    """Every batch tile, warp count and prefetch depth, x from global or shared memory (2 stages, two
    barriers a pair; 3 or 4, one), one to five programs an SM (stream-K: parts summed across programs)
    or S programs a tile (split-K: 1, 2, 3, as many as fill a wave, more than the tile's 10 pairs):
    within the bound, the same bits on a second call, the tile counters back at zero."""
    from kvserve.kernels import gluon_w4a16 as g

    bn, bm, nw, per_sm, prefetch, x_smem, split, x_stages = (*tiles, tiles[4] + 1)[:8]  # (x stages: a buffer each)
    m, n, k = 2 * bm - 3, 3 * bn + 5, 1152 + (0 if x_smem else 64)  # (x_smem: K a multiple of 128)
    t = g.GluonTiles(bn, bm, nw, per_sm, prefetch, x_smem, split, x_stages=x_stages)
    x, wt, y = _tiles_ok(m, n, k, bn + bm + nw, torch.bfloat16, t)
    with pytest.raises(ValueError, match="block_m in 8, 16, 32, 64"):
        g.w4a16_mma_matmul(x, wt, y, g.GluonTiles(bn, 24, nw))
    with pytest.raises(ValueError, match="prefetch 1, 2 or 3"):
        g.w4a16_mma_matmul(x, wt, y, g.GluonTiles(bn, bm, nw, prefetch=4))
    with pytest.raises(ValueError, match="split None or >= 0"):
        g.w4a16_mma_matmul(x, wt, y, g.GluonTiles(bn, bm, nw, split=-1))
    if x_smem:
        with pytest.raises(ValueError, match=r"x_smem: x_stages 2 or prefetch \+ 1"):
            g.w4a16_mma_matmul(x, wt, y, g.GluonTiles(bn, bm, nw, prefetch=2, x_smem=True, x_stages=4))


@gpu
@pytest.mark.parametrize("tiles", [(64, 128, 4, None, 2, None, 3, False), (128, 128, 8, None, 1, 0, 3, False),
                                   (64, 64, 4, None, 1, 1, 2, False), (64, 128, 4, 1, 2, None, 4, False),
                                   (128, 64, 8, None, 2, 3, 4, False), (64, 256, 4, None, 1, None, 2, False),
                                   (64, 32, 4, None, 2, 0, 3, True), (64, 16, 4, None, 3, None, 4, True),
                                   (128, 64, 8, None, 1, None, 3, True), (128, 128, 8, None, 2, None, 3, False, True),
                                   (64, 64, 4, None, 1, 0, 4, True, True), (64, 128, 4, 1, 2, None, 3, False, True),
                                   (128, 32, 8, None, 3, 3, 3, False, True)],
                         ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_w4a16_wgmma(tiles, dtype):
    """The warpgroup-MMA path (sm_90): batch tiles 16-256, one or two warpgroups, stream-K (one or
    more programs an SM), split-K (1, 3, a wave's worth), 2-4 x stages; M, N not multiples of the
    tile and K not of 128 (x zero-padded by ``mma_order``), or, with ``x_gather``, K a multiple of
    128 and x put in MMA order by the kernel; with ``mma_overlap`` (the last field), each pair's second
    wgmma left running into the next pair: within the float64 bound, the same bits on a second call,
    the tile counters back at zero."""
    from kvserve.kernels import gluon_w4a16 as g

    if not g.wgmma_available(torch.device("cuda")):
        pytest.skip("warpgroup MMAs need sm_90")
    bn, bm, nw, per_sm, prefetch, split, x_stages, x_gather, overlap = (*tiles, False)[:9]
    m, n, k = 2 * bm - 3, 3 * bn + 5, 1152 + (0 if x_gather else 64)
    t = g.GluonTiles(bn, bm, nw, per_sm, prefetch, False, split, wgmma=True, x_stages=x_stages, x_gather=x_gather,
                     mma_overlap=overlap)
    x, wt, y = _tiles_ok(m, n, k, bn + bm + nw + x_stages, dtype, t)
    with pytest.raises(ValueError, match="x_stages 2, 3 or 4"):
        g.w4a16_mma_matmul(x, wt, y, g.GluonTiles(bn, bm, nw, wgmma=True, x_stages=5))
    with pytest.raises(ValueError, match="mma_overlap: wgmma with x_stages 3 or 4"):
        g.w4a16_mma_matmul(x, wt, y, g.GluonTiles(bn, bm, nw, wgmma=True, x_stages=2, mma_overlap=True))


@gpu
@pytest.mark.parametrize("m,cap", [(1, 80), (8, 72), (16, 128), (32, 168)])
def test_gluon_w4a16_register_cap_changes_no_bit(m, cap):
    """``GluonTiles.maxnreg`` (ptxas keeps the kernel within that many registers, so more programs fit an
    SM) changes no bit: the default tiles of the batch capped give the uncapped tiles' bits, within the
    float64 bound (72 registers spill 8 bytes at batch 8: still exact)."""
    import dataclasses

    from kvserve.kernels import gluon_w4a16 as g

    t = g.default_tiles(m, g.wgmma_available(torch.device("cuda")))
    x, wt, y = _tiles_ok(m, 3 * t.block_n + 6, 1152, m + cap, torch.bfloat16, dataclasses.replace(t, maxnreg=cap))
    assert torch.equal(g.w4a16_mma_matmul(x, wt, torch.full_like(y, float("nan")), t), y)


@gpu
@pytest.mark.parametrize("m,evict", [(1, ""), (8, "evict_last"), (16, "evict_first"), (32, "evict_last"),
                                     (64, "evict_last"), (128, "")])
def test_gluon_w4a16_eviction_policy_changes_no_bit(m, evict):
    """``GluonTiles.w_eviction_policy`` (how long the weights' cache lines stay) changes no bit: the
    batch's default tiles with another policy give the default's bits, within the float64 bound."""
    import dataclasses

    from kvserve.kernels import gluon_w4a16 as g

    t = g.default_tiles(m, g.wgmma_available(torch.device("cuda")))
    other = dataclasses.replace(t, w_eviction_policy=evict)
    if other == t:  # (off sm_90 the defaults take no policy)
        other = dataclasses.replace(t, w_eviction_policy="evict_first")
    x, wt, y = _tiles_ok(m, 3 * t.block_n + 6, 1152, m + len(evict), torch.bfloat16, other)
    assert torch.equal(g.w4a16_mma_matmul(x, wt, torch.full_like(y, float("nan")), t), y)


def test_gluon_w4a16_rejects_an_unknown_eviction_policy():
    """An eviction policy other than those gl.load takes is refused before any launch, naming them."""
    from kvserve.kernels import gluon_w4a16 as g
    from kvserve.kernels.triton_w4a16 import pack_w4a16

    (packed, block_scale, s2), gen = _quantized(64, 256, 3)
    x = torch.randn(2, 256, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="w_eviction_policy '', 'evict_first' or 'evict_last'"):
        g.w4a16_mma_matmul(x, pack_w4a16(packed, block_scale, s2), torch.empty(2, 64, dtype=torch.bfloat16),
                           g.GluonTiles(w_eviction_policy="no_allocate"))


@pytest.mark.parametrize("cap", [16, 256])
def test_gluon_w4a16_rejects_a_register_cap_ptxas_cannot_take(cap):
    """A register cap outside 32-255 is refused before any launch, naming the accepted range."""
    from kvserve.kernels import gluon_w4a16 as g
    from kvserve.kernels.triton_w4a16 import pack_w4a16

    (packed, block_scale, s2), gen = _quantized(64, 256, cap)
    x = torch.randn(2, 256, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="maxnreg None or 32-255"):
        g.w4a16_mma_matmul(x, pack_w4a16(packed, block_scale, s2), torch.empty(2, 64, dtype=torch.bfloat16),
                           g.GluonTiles(maxnreg=cap))


@gpu
@pytest.mark.parametrize("shape", [(128, 17408, 5120), (256, 5120, 17408), (96, 34816, 5120)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_w4a16_wgmma_27b_shapes(shape):
    """The warpgroup-MMA path on the 27B's MLP shapes at prefill-sized batches, against float64."""
    from kvserve.kernels import gluon_w4a16 as g
    from kvserve.kernels.triton_w4a16 import pack_w4a16

    if not g.wgmma_available(torch.device("cuda")):
        pytest.skip("warpgroup MMAs need sm_90")
    m, n, k = shape
    (packed, block_scale, s2), gen = _quantized(n, k, m + n + k)
    x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16)
    wt = pack_w4a16(packed.cuda(), block_scale.cuda(), s2.cuda())
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    g.w4a16_mma_matmul(x.cuda(), wt, y)  # the default tiles: 128 x 128 x 8 warps
    assert not bool(torch.isnan(y).any())
    assert _bound_ok(y.cpu(), x, _exact(packed, block_scale, s2))


@gpu
@pytest.mark.parametrize("tiles", [(64, 8, 4, None, 3, False, 0, False, False, False),
                                   (64, 16, 4, None, 2, True, None, False, False, False),
                                   (64, 32, 4, None, 2, False, None, True, True, False),
                                   (128, 128, 8, None, 2, False, None, True, False, True)],
                         ids=["bm8-split", "bm16-x-smem-3-buffers", "wgmma-bm32-gather",
                              "wgmma-bm128-permuted-overlap"])
def test_gluon_w4a16_pdl_chain_waits_for_its_input(tiles):
    """Programmatic dependent launch: three launches chained (each one's y the next one's x, the
    output buffers poisoned with NaN first), eager and inside a CUDA graph, give the bits of the same
    chain without PDL: a launch that read its x before the previous kernel's stores would differ."""
    from kvserve.kernels import gluon_w4a16 as g
    from kvserve.kernels.triton_w4a16 import pack_w4a16

    bn, bm, nw, per_sm, prefetch, x_smem, split, wgmma, gather, overlap = tiles
    if wgmma and not g.wgmma_available(torch.device("cuda")):
        pytest.skip("warpgroup MMAs need sm_90")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    n = k = 4096  # square: y feeds the next launch as x
    (packed, block_scale, s2), gen = _quantized(n, k, 11)
    wt = pack_w4a16(packed.cuda(), block_scale.cuda(), s2.cuda())
    x = torch.randn(bm - 1, k, generator=gen).to(torch.bfloat16).cuda()

    def chain(pdl: bool, ys: list) -> None:
        t = g.GluonTiles(bn, bm, nw, per_sm, prefetch, x_smem, split, wgmma=wgmma, x_gather=gather, pdl=pdl,
                         mma_overlap=overlap, x_stages=3 if wgmma else prefetch + 1)
        g.w4a16_mma_matmul(x, wt, ys[0], t)
        g.w4a16_mma_matmul(ys[0], wt, ys[1], t)
        g.w4a16_mma_matmul(ys[1], wt, ys[2], t)

    want = [torch.empty_like(x) for _ in range(3)]
    chain(False, want)
    got = [torch.full_like(x, float("nan")) for _ in range(3)]
    chain(True, got)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for y in got:
        y.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(True, got)
    for y in got:
        y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_mma_order_places_each_feature_at_its_mma_column():
    """``mma_order`` (the wgmma path's x): in every chunk of 64 features, position 16 j + 8 h + 2 q + e
    holds feature 16 q + 4 j + 2 h + e, the column the weight decode gives that feature; past K zeros
    up to whole pairs of chunks."""
    from kvserve.kernels import gluon_w4a16 as g

    m, k, n_pairs = 3, 200, 2
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = g.mma_order(x, n_pairs)
    assert got.shape == (m, 128 * n_pairs)
    want = torch.zeros(m, 128 * n_pairs, dtype=x.dtype)
    for chunk in range(2 * n_pairs):
        for q in range(4):
            for j in range(4):
                for h in range(2):
                    for e in range(2):
                        f = 64 * chunk + 16 * q + 4 * j + 2 * h + e
                        if f < k:
                            want[:, 64 * chunk + 16 * j + 8 * h + 2 * q + e] = x[:, f]
    assert torch.equal(got, want)
    assert torch.equal(g.mma_order(x[:, :128], 1), want[:, :128])  # K a whole pair: no padding


@gpu
def test_w4a16_linear_dispatch_and_cuda_graph(monkeypatch):
    """Decode batches (up to ``max_rows``: 64, 256 on sm_90) take the Gluon kernel with the default
    tiles, larger ones and fp32 the Triton path, with the same product up to the bound; the Gluon
    launch replays in a CUDA graph."""
    from kvserve.kernels import gluon_w4a16 as g
    from kvserve.kernels.triton_w4a16 import pack_w4a16, w4a16_matmul

    n, k = 384, 640
    (packed, block_scale, s2), gen = _quantized(n, k, 5)
    wt = pack_w4a16(packed.cuda(), block_scale.cuda(), s2.cuda())
    w64 = _exact(packed, block_scale, s2)
    top, sm90 = g.max_rows(torch.device("cuda"), torch.bfloat16), g.wgmma_available(torch.device("cuda"))
    assert g.max_rows(torch.device("cuda"), torch.float32) == 0
    assert top == (256 if sm90 else 64)
    launched = []
    mma_matmul = g.w4a16_mma_matmul
    monkeypatch.setattr(g, "w4a16_mma_matmul", lambda x2, w, y, tiles=None: launched.append(x2.shape[0])
                        or mma_matmul(x2, w, y, tiles))
    for m in (1, 7, 20, 32, 33, top // 2, top // 2 + 1, 300):
        launched.clear()
        x = torch.randn(2, m, k, generator=gen).to(torch.bfloat16).cuda()
        y = g.w4a16_linear(x, wt)
        assert launched == ([2 * m] if 2 * m <= top else [])
        assert y.shape == (2, m, n) and _bound_ok(y.reshape(-1, n).cpu(), x.reshape(-1, k).cpu(), w64,
                                                 weight_unit=2.0**-8 if 2 * m > top else 0.0)
    assert g.default_tiles(8, sm90).pdl == sm90 and g.default_tiles(64, sm90).wgmma == sm90
    assert g.default_tiles(200, sm90).mma_overlap == sm90
    monkeypatch.undo()
    x32 = torch.randn(3, k, generator=gen).cuda()
    assert torch.equal(g.w4a16_linear(x32, wt), w4a16_matmul(x32, wt))
    x = torch.randn(4, k, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty(4, n, dtype=torch.bfloat16, device="cuda")
    g.w4a16_linear(x, wt, out=out)  # compiled and the occupancy read before the capture
    want = out.clone()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.w4a16_linear(x, wt, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


_COMPILE = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kvserve.kernels import gluon_w4a16 as g

variant = (json.loads(sys.argv[1]) + [False, None][len(json.loads(sys.argv[1])) - 11:])[:13]  # (overlap, maxnreg)
bn, bm, nw, fp16, even_k, prefetch, x_smem, wgmma, x_stages, x_gather, pdl, overlap, maxnreg = variant
if g.gluon is None:
    print(json.dumps(None))
    sys.exit()
ty = "fp16" if fp16 else "bf16"
sig = {"x_ptr": f"*{ty}", "w_ptr": "*i32", "s_ptr": "*i16", "g_ptr": "*fp32", "y_ptr": f"*{ty}", "part_ptr": "*fp32",
       "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "n_pairs": "i32", "tiles_m": "i32", "units": "i32",
       "programs": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_wp": "i32", "stride_sn": "i32",
       "stride_sp": "i32", "stride_ym": "i32"}
pair, scales, chunk, acts = g._layouts(bn, bm, nw)
xcp, xs = g._x_smem_layouts(bm, nw)
if wgmma:
    xcp = g._x_chunk_copy_layout(nw, x_gather)
consts = dict(BLOCK_N=bn, BLOCK_M=bm, NUM_WARPS=nw, FP16=fp16, EVEN_K=even_k, PREFETCH=prefetch, X_SMEM=x_smem,
              PAIR_L=pair, SCALE_L=scales, CHUNK_L=chunk, ACT_L=acts, XCP_L=xcp, XS_L=xs, WGMMA=wgmma,
              X_STAGES=x_stages, X_GATHER=x_gather, PDL=pdl, OVERLAP=overlap, W_EP='')
aligned = ("x_ptr", "w_ptr", "s_ptr", "g_ptr", "y_ptr", "part_ptr", "lock_ptr", "stride_xm", "stride_wn", "stride_wp",
           "stride_ym")  # as the launcher specializes them (16-byte aligned tensors, strides multiples of 16)
attrs = {(list(sig).index(a),): [["tt.divisibility", 16]] for a in aligned}
src = GluonASTSource(fn=g._w4a16_mma_kernel, signature=sig, constexprs=consts, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": nw, **({"maxnreg": maxnreg} if maxnreg else {})})
ptx = k.asm["ptx"]


def copy_bar_read(ptx):
    # the most CTA barriers between an x copy (its commit) and the next shared-memory read
    most, count = 0, None
    for line in ptx.splitlines():
        if "cp.async.commit_group" in line:
            count = 0
        elif count is not None and re.search(r"\\b(?:bar|barrier)\\.sync\\b", line):
            count += 1
        elif count is not None and "ld.shared" in line:
            most, count = max(most, count), None
    return most


print(json.dumps({"mma": ptx.count("mma.sync.aligned.m16n8k16"), "ld_shared": ptx.count("ld.shared"),
                  "wgmma": ptx.count("wgmma.mma_async.sync.aligned.m64n%dk16.f32" % bm),
                  "gdc": [ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")],
                  "cp_async": ptx.count("cp.async.cg.shared.global"),
                  "cp_async_4": sum(1 for line in ptx.splitlines()
                                    if "cp.async.ca.shared.global" in line and line.rstrip().endswith("0x4, 0x4;")),
                  "st_shared": ptx.count("st.shared"), "shared": k.metadata.shared,
                  "copy_bar_read": copy_bar_read(ptx),
                  "maxnreg": [int(line.split()[-1]) for line in ptx.splitlines() if line.startswith(".maxnreg")],
                  "local": ptx.count("ld.local") + ptx.count("st.local")}))
"""


@pytest.mark.parametrize("variant", [(128, 8, 4, False, True, 2, False, False, 2, False, False),
                                     (64, 32, 2, True, False, 2, False, False, 2, False, False),
                                     (128, 16, 8, False, True, 3, False, False, 2, False, False),
                                     (64, 32, 2, False, True, 2, True, False, 2, False, True),
                                     (64, 8, 4, False, True, 3, False, False, 2, False, True),
                                     (64, 128, 4, False, True, 2, False, True, 3, False, False),
                                     (128, 64, 8, True, True, 1, False, True, 4, False, False),
                                     (64, 32, 4, False, True, 2, False, True, 3, True, True),
                                     (64, 64, 4, False, True, 2, False, True, 3, False, False),
                                     (128, 128, 8, False, True, 2, False, True, 3, False, False),
                                     (128, 128, 8, False, True, 2, False, True, 3, False, False, True),
                                     (64, 64, 4, True, True, 1, False, True, 4, True, True, True),
                                     (64, 8, 4, False, True, 3, False, False, 2, False, True, False, 80),
                                     (128, 32, 4, False, True, 2, True, False, 3, False, True, False, 168),
                                     (128, 32, 4, False, True, 2, True, False, 3, False, True),
                                     (128, 16, 4, True, True, 3, True, False, 4, False, True)],
                         ids=["bf16-bm8-prefetch2", "fp16-bm32-oddK-prefetch2", "bf16-bm16-prefetch3",
                              "bf16-bm32-x-smem-pdl", "bf16-default-bm8-pdl", "bf16-wgmma-bm128", "fp16-wgmma-bm64-8warps",
                              "bf16-wgmma-bm32-gather-pdl", "bf16-default-wgmma-bm64", "bf16-wgmma-bm128-8warps",
                              "bf16-default-wgmma-bm128-overlap", "fp16-wgmma-bm64-gather-pdl-overlap",
                              "bf16-default-bm8-pdl-maxnreg-80", "bf16-default-bm32-pdl-maxnreg-168",
                              "bf16-bm32-x-smem-3-stages-pdl", "fp16-bm16-x-smem-4-stages-pdl"])
def test_gluon_w4a16_compiles_for_sm90(variant):
    """The kernel compiles to sm_90 with this machine's triton: mma.sync (the unrolled loop's and its
    tail's), no spills, and shared memory only to hand the tile counter's value (one atomic) to the
    program's threads, or with ``x_smem`` for x's stages (with a buffer a stage, no CTA barrier between
    a copy and the next reads: one barrier a pair); the weights are never staged there.
    The default tiles (batch 8; wgmma 64 and 128 rows) are among them. With ``wgmma``: m64nBMk16
    wgmmas (four a chunk, two chunks a pair, for each 64 rows of a warpgroup), A from registers (no
    shared-memory round trip: the one ld.shared is the counter's), x's stages the only shared memory
    (with ``mma_overlap``, the last field, too: one copy fewer in flight, the same buffers); with
    ``x_gather`` x's copies are 4-byte pieces (two features of one MMA column pair). With ``pdl`` the kernel lets the next one
    launch and waits for the previous one (one griddepcontrol each, before the tile loop's x and stores:
    the wait sits in the loop, once a tile); without it, neither. (In a fresh process, outside the
    interpreter mode and its patches that this test session runs under.) With a register cap (``maxnreg``,
    the last field) the PTX asks ptxas for it (``.maxnreg``)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(list(variant))], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    if got is None:
        pytest.skip("this triton has no Gluon")
    bn, bm, nw = variant[:3]
    prefetch = variant[5]  # the loop body multiplies prefetch + 1 pairs, the tail up to prefetch more
    if variant[7]:  # wgmma: the x stages (x_stages pairs of [BM, 64] x 2 chunks) and the counter's word
        x_stages = variant[8]
        assert got["mma"] == 0 and got["wgmma"] == 4 * (bn // (16 * nw)) * 2 * (2 * prefetch + 1)
        assert got["ld_shared"] == 1 and got["st_shared"] == 1
        if variant[9]:  # x_gather: 4-byte pieces only
            assert got["cp_async"] == 0 and got["cp_async_4"] > 0
        else:  # the permuted copy: 16-byte pieces only
            assert got["cp_async"] > 0 and got["cp_async_4"] == 0
        assert 2 * x_stages * bm * 64 * 2 <= got["shared"] <= 2 * x_stages * bm * 64 * 2 + 16
    elif variant[6]:  # x_smem: x_stages stages of x [BM, 128] copied in by cp.async, read back, no weights staged
        stages = variant[8]
        assert got["cp_async"] >= 1 and got["ld_shared"] > 1
        assert stages * bm * 256 <= got["shared"] <= stages * bm * 256 + 16
        # a buffer a stage (x_stages = prefetch + 1): the one barrier a pair comes before the next copy, none
        # between it and the reads; two stages of one buffer (prefetch 2 or 3): a barrier between them
        assert got["copy_bar_read"] == (0 if stages == variant[5] + 1 else 1)
    else:
        assert got["ld_shared"] == 1 and got["st_shared"] == 1 and got["shared"] <= 16
    assert got["local"] == 0
    assert got["gdc"] == ([1, 1] if variant[10] else [0, 0])
    maxnreg = (*variant, False, None)[12]  # a register cap: the PTX asks ptxas for it (.maxnreg), else nothing
    assert got["maxnreg"] == ([maxnreg] if maxnreg else [])
