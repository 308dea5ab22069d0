"""Triton GDN kernels (kernels/triton_gdn.py) against the torch reference, on CPU in the Triton
interpreter (GPU: the same tests with larger shapes): a step of several sequences of different
lengths (decodes and prefill chunks), some continuing from their state slot and some starting
fresh, slots out of order; outputs and the updated state pools, fp32 and bf16."""

from __future__ import annotations

import zlib

import pytest
import torch

from kvserve.kernels import gdn_reference as ref
from triton_support import skip_without_triton_device

pytestmark = skip_without_triton_device()

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# (H, HV, K, V); (1, 2, 128, 128) has the 27B's head dims (several V blocks per head), the GPU adds its head counts
SHAPES = [(2, 4, 16, 32), (1, 1, 32, 16), (2, 2, 24, 8), (1, 2, 128, 128)] + ([(16, 32, 128, 128)] if CUDA else [])
LENS = [1, 1, 5, 2, 9, 1, 3]


def _step(gen, lens, num_slots):
    slots = torch.randperm(num_slots, generator=gen)[: len(lens)].tolist()
    has_state = [bool(i % 3) for i in range(len(lens))]  # sequences 0, 3, 6 start fresh
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)  # noqa: E731
    return slots, has_state, qsl, as_t(qsl), as_t(slots), as_t([int(h) for h in has_state])


def _reference_rule(q, k, v, g, beta, pool, slots, has_state, qsl):
    """The reference delta rule sequence by sequence: outputs and the pool after the step."""
    want_pool = pool.clone()
    want = torch.empty(v.shape, dtype=q.dtype)
    for i, (slot, has) in enumerate(zip(slots, has_state)):
        s, e = qsl[i], qsl[i + 1]
        o, st = ref.recurrent_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                               initial_state=pool[slot] if has else None)
        want[s:e], want_pool[slot] = o, st
    return want, want_pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("W", [4, 2])
@pytest.mark.parametrize("chunked", [False, True], ids=["tokens", "chunks"])
def test_causal_conv1d_varlen_equals_reference(dtype, shape, W, chunked):
    """Both launch forms: each program walking its sequence (decodes), and all tokens in parallel
    over a chunk plan (prefills: sequences shorter than W - 1, one chunk, several chunks)."""
    from kvserve.kernels.triton_gdn import causal_conv1d_varlen
    from kvserve.kernels.triton_gdn import plan_chunks

    H, HV, K, V = shape
    C = 2 * H * K + HV * V
    gen = torch.Generator().manual_seed(hash((str(dtype), shape, W, chunked)) % 2**31)
    lens = [1, 70, 2, 130, 3, 64] if chunked else LENS
    slots, has_state, qsl, qsl_t, slots_t, has_t = _step(gen, lens, 9)
    x = torch.randn(qsl[-1], C, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(C, W, generator=gen) * 0.5).to(dtype).to(DEV)
    pool = torch.randn(9, C, W - 1, generator=gen).to(dtype).to(DEV)
    want_pool = pool.clone()
    want = torch.empty_like(x)
    for i, (slot, has) in enumerate(zip(slots, has_state)):
        y, st = ref.causal_conv1d(x[qsl[i]: qsl[i + 1]].cpu(), w.cpu(), pool[slot].cpu() if has else None)
        want[qsl[i]: qsl[i + 1]] = y.to(DEV)
        want_pool[slot] = st.to(DEV)
    got = causal_conv1d_varlen(x, w, pool, qsl_t, slots_t, has_t, plan_chunks(lens, x.device) if chunked else None)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert torch.equal(pool, want_pool)  # raw inputs moved, bit for bit; untouched slots unchanged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_delta_rule_varlen_equals_reference(dtype, shape):
    _check_delta_rule(dtype, shape, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_v", [64, 128])
def test_gated_delta_rule_varlen_wide_tiles(dtype, block_v):
    """The wider V tiles (the default from two programs an SM: ``delta_rule_tile``) at the 27B's head
    dims, which this step is too small to get by default."""
    _check_delta_rule(dtype, (1, 2, 128, 128), block_v)


def test_delta_rule_tile_widens_when_the_programs_fill_the_gpu():
    from kvserve.kernels.triton_gdn import delta_rule_tile

    assert delta_rule_tile(32, 48, 128, 132) == delta_rule_tile(8, 48, 128, 132) == (64, 4)
    assert delta_rule_tile(1, 48, 128, 132) == delta_rule_tile(2, 48, 128, 132) == (32, 4)  # 96 / 192 < 264
    assert delta_rule_tile(64, 4, 32, 132) == (32, 4) and delta_rule_tile(64, 4, 16, 132) == (16, 4)


def _check_delta_rule(dtype, shape, block_v):
    from kvserve.kernels.triton_gdn import gated_delta_rule_varlen

    H, HV, K, V = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), shape)).encode()))
    slots, has_state, qsl, qsl_t, slots_t, has_t = _step(gen, LENS, 9)
    T = qsl[-1]
    q = torch.randn(T, H, K, generator=gen).to(dtype)
    k = torch.randn(T, H, K, generator=gen).to(dtype)
    v = torch.randn(T, HV, V, generator=gen).to(dtype)
    a, b = torch.randn(T, HV, generator=gen).to(dtype), torch.randn(T, HV, generator=gen).to(dtype)  # raw gates
    A_log, dt_bias = (torch.randn(HV, generator=gen) * 0.5).to(dtype), torch.randn(HV, generator=gen).to(dtype)
    g, beta = ref.gdn_gates(A_log, a, dt_bias, b)
    pool = torch.randn(9, HV, K, V, generator=gen) * 0.3
    want, want_pool = _reference_rule(q, k, v, g, beta, pool, slots, has_state, qsl)
    dev_pool = pool.to(DEV)
    got = gated_delta_rule_varlen(q.to(DEV), k.to(DEV), v.to(DEV), a.to(DEV), b.to(DEV), A_log.to(DEV),
                                  dt_bias.to(DEV), dev_pool, qsl_t, slots_t, has_t, block_v=block_v)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float().cpu(), want.float(), **tol)
    torch.testing.assert_close(dev_pool.cpu(), want_pool, atol=2e-5, rtol=2e-5)
    assert torch.equal(dev_pool.cpu()[[i for i in range(9) if i not in slots]],
                       pool[[i for i in range(9) if i not in slots]])


# (H, HV, K, V) for the chunk-parallel rule; the GPU adds the 27B's heads and long prefills
CHUNK_CASES = [((2, 4, 16, 32), [1, 70, 7, 64, 16, 130, 33]), ((2, 2, 24, 16), [40, 1, 65]),
               ((1, 2, 128, 128), [65, 3, 20])]
# (the 27B case in the model dtypes only: float32 at K = V = 128 is the (1, 2, 128, 128) case, and
# each float32 head layout costs a long compile of the IEEE kernels)
CUDA_CASES = [((16, 48, 128, 128), [1, 1024, 70, 300, 64, 2])] if CUDA else []
CHUNK_PARAMS = [(d, c) for c in CHUNK_CASES for d in (torch.float32, torch.bfloat16, torch.float16)] + [
    (d, c) for c in CUDA_CASES for d in (torch.bfloat16, torch.float16)]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("dtype, case", CHUNK_PARAMS,
                         ids=lambda x: "x".join(map(str, x[0])) if isinstance(x, tuple) else str(x).split(".")[-1])
def test_chunk_gated_delta_rule_equals_reference(dtype, case):
    """The chunk-parallel rule (raw gates in, states in place) == the reference sequence by
    sequence: prefills longer and shorter than a chunk, one-token rows, fresh and continuing
    states, slots out of order; outputs poisoned first, untouched slots bit for bit.

    Bounds: the kernel rounds its operands to the model dtype in four stages (normalised k, w/u
    and T, the chunk states, v_new), each a relative error of at most the unit roundoff u; the bound
    is 4u of the largest reference value (fp32: the two summation orders differ by ~1.5e-6 of it,
    measured; 4u is 2.4e-7, so fp32 gets 2e-5, 13x the measured difference)."""
    from kvserve.kernels.triton_gdn import plan_chunks
    from kvserve.kernels.triton_gdn_chunk import chunk_gated_delta_rule

    (H, HV, K, V), lens = case
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), H, HV, K, V)).encode()))
    slots, has_state, qsl, qsl_t, slots_t, has_t = _step(gen, lens, len(lens) + 3)
    T, C = qsl[-1], 2 * H * K + HV * V
    y = torch.randn(T, C, generator=gen).to(dtype)  # the conv output: q | k | v columns
    a, b = torch.randn(T, HV, generator=gen).to(dtype), torch.randn(T, HV, generator=gen).to(dtype)
    A_log, dt_bias = (torch.randn(HV, generator=gen) * 0.5).to(dtype), torch.randn(HV, generator=gen).to(dtype)
    pool = torch.randn(len(lens) + 3, HV, K, V, generator=gen) * 0.3
    yd, ad, bd, A_log_d, dt_bias_d = y.to(DEV), a.to(DEV), b.to(DEV), A_log.to(DEV), dt_bias.to(DEV)
    # the reference on the kernel's device (the 27B case would take minutes on the CPU)
    q, k, v = yd[:, : H * K].view(T, H, K), yd[:, H * K: 2 * H * K].view(T, H, K), yd[:, 2 * H * K:].view(T, HV, V)
    g, beta = ref.gdn_gates(A_log_d, ad, dt_bias_d, bd)
    want, want_pool = torch.empty(T, HV, V), pool.clone()
    for i, (slot, has) in enumerate(zip(slots, has_state)):
        s, e = qsl[i], qsl[i + 1]
        o, st = ref.chunk_gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                           initial_state=pool[slot].to(DEV) if has else None, use_qk_l2norm=True)
        want[s:e], want_pool[slot] = o.float().cpu(), st.cpu()
    dev_pool = pool.to(DEV)
    out = torch.full((T, HV, V), float("nan"), dtype=dtype, device=DEV)
    chunk_gated_delta_rule(
        yd[:, : H * K].view(T, H, K), yd[:, H * K: 2 * H * K].view(T, H, K), yd[:, 2 * H * K:].view(T, HV, V),
        ad, bd, A_log_d, dt_bias_d, dev_pool, qsl_t, slots_t, has_t,
        plan_chunks(lens, torch.device(DEV)), out=out,
    )
    rel = 2e-5 if dtype == torch.float32 else 4 * UNIT_ROUNDOFF[dtype]
    got = out.float().cpu()
    assert not got.isnan().any()
    assert (got - want).abs().max() <= rel * want.abs().max()
    got_pool = dev_pool.cpu()
    assert (got_pool - want_pool).abs().max() <= rel * want_pool.abs().max()
    untouched = [i for i in range(len(lens) + 3) if i not in slots]
    assert torch.equal(got_pool[untouched], pool[untouched])
