"""The fused temperature sampler (``kernels/triton_sampling.py``), in the Triton interpreter on CPU
(and on the GPU when there is one): greedy rows equal ``torch.argmax`` (ties to the lowest id),
sampled frequencies follow ``softmax(x / T)`` (chi-square), a seeded request's token depends on
its seed and position only, and the ``Sampler`` takes the kernel only for temperature-only rows."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.sampling import SamplingParams
from kvserve.kernels.triton_sampling import gumbel_argmax, seeded_key
from kvserve.runner.sampler import Sampler, SamplingRow

from triton_support import kernel_device, skip_without_triton_device

DEV = kernel_device()
pytestmark = skip_without_triton_device()


def _run(logits, temps, keys, counters, splits=None):
    t = lambda v, dt: torch.tensor(v, dtype=dt, device=DEV)  # noqa: E731
    args = (logits.to(DEV), t(temps, torch.float32), t(keys, torch.int32), t(counters, torch.int32))
    return gumbel_argmax(*args, splits=splits).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 300, 5000])
def test_greedy_rows_are_argmax_with_lowest_id_ties(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=gen).to(dtype)
    x[1, vocab // 2] = x[1, vocab - 1] = 50.0  # a tie: the lower id wins
    x[2, vocab - 1] = 60.0  # the maximum in the last (masked) tile
    x[3, 0] = 70.0
    got = _run(x, [0.0] * 5, [123] * 5, [0, 1, 2, 3, 4])
    assert got.tolist() == x.float().argmax(dim=-1).tolist()
    assert got[1] == vocab // 2 and got[2] == vocab - 1 and got[3] == 0


@pytest.mark.parametrize("vocab,rows", [(7, 6), (5000, 6), (70000, 3)])
def test_splits_give_the_same_tokens(vocab, rows):
    """Splitting a row's vocabulary over programs keeps every column's uniform: splits 1, 2, 3 and
    auto draw the same tokens; greedy rows are ``torch.argmax``, a tie across two splits included."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab, generator=gen) * 2.0
    lo, hi = 1, vocab - 1  # in the first and last split (5000: 2 groups of 4096 columns, 70,000: 18)
    x[0, lo] = x[0, hi] = 40.0
    temps = [0.0, 0.5, 1.0, 0.0, 1.7, 0.8][:rows]
    keys = [seeded_key(5, i) if i % 2 else 77 for i in range(rows)]
    got = [_run(x, temps, keys, [i * vocab for i in range(rows)], splits=n) for n in (1, 2, 3, None)]
    for other in got[1:]:
        assert other.tolist() == got[0].tolist()
    greedy = [i for i, t in enumerate(temps) if t == 0.0]
    sampled = [i for i, t in enumerate(temps) if t > 0.0]
    assert got[0][greedy].tolist() == x[greedy].argmax(dim=-1).tolist() and got[0][0] == lo
    assert got[0][sampled].tolist() != x[sampled].argmax(dim=-1).tolist()  # the noise is there


@pytest.mark.parametrize("vocab,temp,n", [(24, 0.7, 2000), (24, 2.0, 2000), (4500, 1.0, 800)])
def test_sampled_frequencies_follow_softmax(vocab, temp, n):
    """``n`` independent draws of one distribution (each row its own counter range): Pearson's
    chi-square over the likely tokens stays below the 0.1% critical value."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(vocab, generator=gen) * 1.5
    if vocab > 1000:
        x[:] = -30.0  # a few likely tokens spread over several tiles, the rest negligible
        for i, v in zip((3, 1500, 2100, 4097, 4499), (1.0, 0.5, 0.0, 1.2, -0.3)):
            x[i] = v
    rows = x.expand(n, vocab).contiguous()
    got = _run(rows, [temp] * n, [987654] * n, [i * vocab for i in range(n)])
    probs = torch.softmax(x.double() / temp, dim=0)
    counts = torch.bincount(got, minlength=vocab).double()
    likely = probs * n >= 5
    assert counts[~likely].sum() <= max(5.0, float(probs[~likely].sum() * n * 3))
    expected = probs[likely] * n
    chi2 = float(((counts[likely] - expected) ** 2 / expected).sum())
    df = int(likely.sum()) - 1
    critical = {4: 18.47, 23: 49.73}.get(df, df + 3.3 * (2 * df) ** 0.5)  # chi-square 0.999 quantiles
    assert chi2 < critical, f"chi2 {chi2:.1f} >= {critical:.1f} (df {df})"
    # and the draws are not all the same token (the noise is really there)
    assert len(set(got.tolist())) > 3


def test_seeded_rows_depend_on_seed_and_position_only():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=gen)
    key = seeded_key(42, 9)
    alone = _run(x[2:3], [0.9], [key], [0])
    # the same request (same logits, seed, position) at another row next to other rows
    batch = x.clone()
    batch[4] = x[2]
    got = _run(batch, [0.9] * 6, [seeded_key(1, 1), 5, 6, 7, key, 8], [0, 64, 128, 192, 0, 320])
    assert got[4] == alone[0]
    # across positions the seeded stream moves on: 40 positions give several different tokens
    flat = torch.zeros(40, 64)
    toks = _run(flat, [1.0] * 40, [seeded_key(42, p) for p in range(40)], [0] * 40)
    assert len(set(toks.tolist())) > 10
    assert seeded_key(42, 9) != seeded_key(42, 10) != seeded_key(43, 9)


def _row(**kw):
    return SamplingRow(SamplingParams(**kw), None, 0)


def test_sampler_uses_the_kernel_for_temperature_only_batches(monkeypatch):
    import kvserve.kernels.triton_sampling as ts

    calls = []
    real = ts.gumbel_argmax

    def spy(*a):
        calls.append(a[0].shape)
        return real(*a)

    monkeypatch.setattr(ts, "gumbel_argmax", spy)
    sampler = Sampler(fused=True)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen).to(DEV)
    toks, lps = sampler.sample_tokens(logits, [_row(temperature=0.0), _row(temperature=0.8), _row(temperature=0.8, seed=4)])
    assert calls == [(3, 50)] and lps is None and toks[0] == logits[0].argmax()
    for other in (dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(logprobs=1), dict(repetition_penalty=1.2)):
        sampler.sample_tokens(logits[:2], [_row(temperature=0.8), _row(temperature=0.8, **other)])
    assert len(calls) == 1  # every other batch took the torch path
    # seeded: the same seed and position give the same token in any batch
    a = sampler.sample_tokens(logits[2:3], [_row(temperature=0.8, seed=4)])[0]
    assert a[0] == toks[2]


def test_sampler_falls_back_when_the_kernel_fails(monkeypatch, kvlog):
    import kvserve.kernels.triton_sampling as ts

    def broken(*a):
        raise RuntimeError("no randint4x here")

    monkeypatch.setattr(ts, "gumbel_argmax", broken)
    sampler = Sampler(fused=True)
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(1)).to(DEV)
    toks, _ = sampler.sample_tokens(logits, [_row(temperature=0.0), _row(temperature=0.0)])
    assert toks.tolist() == logits.argmax(dim=-1).tolist() and sampler.fused is False
    assert kvlog.count("Fused sampling kernel unavailable") == 1
