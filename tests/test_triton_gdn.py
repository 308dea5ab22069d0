"""Triton GDN kernels (kernels/triton_gdn.py) against the torch reference, on CPU in the Triton
interpreter (GPU: the same tests with larger shapes): a step of several sequences of different
lengths (decodes and prefill chunks), some continuing from their state slot and some starting
fresh, slots out of order; outputs and the updated state pools, fp32 and bf16."""

from __future__ import annotations

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
def test_causal_conv1d_varlen_equals_reference(dtype, shape, W):
    from kvserve.kernels.triton_gdn import causal_conv1d_varlen

    H, HV, K, V = shape
    C = 2 * H * K + HV * V
    gen = torch.Generator().manual_seed(hash((str(dtype), shape, W)) % 2**31)
    slots, has_state, qsl, qsl_t, slots_t, has_t = _step(gen, LENS, 9)
    x = torch.randn(qsl[-1], C, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(C, W, generator=gen) * 0.5).to(dtype).to(DEV)
    pool = torch.randn(9, C, W - 1, generator=gen).to(dtype).to(DEV)
    want_pool = pool.clone()
    want = torch.empty_like(x)
    for i, (slot, has) in enumerate(zip(slots, has_state)):
        y, st = ref.causal_conv1d(x[qsl[i]: qsl[i + 1]].cpu(), w.cpu(), pool[slot].cpu() if has else None)
        want[qsl[i]: qsl[i + 1]] = y.to(DEV)
        want_pool[slot] = st.to(DEV)
    got = causal_conv1d_varlen(x, w, pool, qsl_t, slots_t, has_t)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert torch.equal(pool, want_pool)  # raw inputs moved, bit for bit; untouched slots unchanged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_delta_rule_varlen_equals_reference(dtype, shape):
    from kvserve.kernels.triton_gdn import gated_delta_rule_varlen

    H, HV, K, V = shape
    gen = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    slots, has_state, qsl, qsl_t, slots_t, has_t = _step(gen, LENS, 9)
    T = qsl[-1]
    q = torch.randn(T, H, K, generator=gen).to(dtype)
    k = torch.randn(T, H, K, generator=gen).to(dtype)
    v = torch.randn(T, HV, V, generator=gen).to(dtype)
    g = -torch.rand(T, HV, generator=gen) * 0.5  # log decays in (-0.5, 0]
    beta = torch.rand(T, HV, generator=gen)
    pool = torch.randn(9, HV, K, V, generator=gen) * 0.3
    want, want_pool = _reference_rule(q, k, v, g, beta, pool, slots, has_state, qsl)
    dev_pool = pool.to(DEV)
    got = gated_delta_rule_varlen(q.to(DEV), k.to(DEV), v.to(DEV), g.to(DEV), beta.to(DEV), dev_pool,
                                  qsl_t, slots_t, has_t)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float().cpu(), want.float(), **tol)
    torch.testing.assert_close(dev_pool.cpu(), want_pool, atol=2e-5, rtol=2e-5)
    assert torch.equal(dev_pool.cpu()[[i for i in range(9) if i not in slots]],
                       pool[[i for i in range(9) if i not in slots]])


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 16, 32), (2, 2, 24, 16), (1, 2, 128, 128)] + ([(16, 32, 128, 128)] if CUDA else []))
def test_chunk_gated_delta_rule_varlen_equals_recurrent_kernel_and_reference(chunk, dtype, shape):
    """Chunked (WY) kernel == the reference for prefill chunks longer and shorter than the chunk,
    decodes and fresh / continuing states; outputs and pools."""
    from kvserve.kernels.triton_gdn import chunk_gated_delta_rule_varlen

    H, HV, K, V = shape
    lens = [1, 40, 7, 33, 16, 2]
    gen = torch.Generator().manual_seed(hash((str(dtype), shape, chunk)) % 2**31)
    slots, has_state, qsl, qsl_t, slots_t, has_t = _step(gen, lens, 8)
    T = qsl[-1]
    q = torch.randn(T, H, K, generator=gen).to(dtype)
    k = torch.randn(T, H, K, generator=gen).to(dtype)
    v = torch.randn(T, HV, V, generator=gen).to(dtype)
    g = -torch.rand(T, HV, generator=gen) * 0.5
    beta = torch.rand(T, HV, generator=gen)
    pool = torch.randn(8, HV, K, V, generator=gen) * 0.3
    want, want_pool = _reference_rule(q, k, v, g, beta, pool, slots, has_state, qsl)
    dev_pool = pool.to(DEV)
    got = chunk_gated_delta_rule_varlen(q.to(DEV), k.to(DEV), v.to(DEV), g.to(DEV), beta.to(DEV), dev_pool,
                                        qsl_t, slots_t, has_t, chunk_size=chunk)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float().cpu(), want.float(), **tol)
    torch.testing.assert_close(dev_pool.cpu(), want_pool, atol=1e-4, rtol=1e-4)
