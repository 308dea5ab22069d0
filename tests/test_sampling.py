"""SamplingParams validation (vLLM's exact messages), the Sampler on synthetic logits, and the
sampling/stop rules end to end on a tiny random Llama."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.sampling import RequestOutputKind
from kvserve.runner.sampler import Sampler, SamplingRow

# ----------------------------------------------------------------------------------------------
# SamplingParams validation
# ----------------------------------------------------------------------------------------------

INVALID = [
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(n=-3), "n must be at least 1, got -3."),
    (dict(n=1.5), "n must be an int, but is of type <class 'float'>"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
    (dict(presence_penalty=-2.01), "presence_penalty must be in [-2, 2], got -2.01."),
    (dict(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2], got -3.0."),
    (dict(frequency_penalty=2.1), "frequency_penalty must be in [-2, 2], got 2.1."),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be greater than zero, got -1.0."),
    (dict(temperature=-1), "temperature must be non-negative, got -1."),
    (dict(temperature=-0.5), "temperature must be non-negative, got -0.5."),
    (dict(top_p=0), "top_p must be in (0, 1], got 0."),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
    (dict(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2."),
    (dict(top_k=-5), "top_k must be 0 (disable), or at least 1, got -5."),
    (dict(min_p=2), "min_p must be in [0, 1], got 2."),
    (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1."),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
    (dict(max_tokens=-4), "max_tokens must be at least 1, got -4."),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
    (dict(max_tokens=4, min_tokens=5), "min_tokens must be less than or equal to max_tokens=4, got 5."),
    (dict(logprobs=-2), "logprobs must be non-negative, got -2."),
    (dict(prompt_logprobs=-3), "prompt_logprobs must be non-negative, got -3."),
    (dict(stop=[""]), "stop cannot contain an empty string."),
    (dict(stop=["ok", ""]), "stop cannot contain an empty string."),
    (dict(stop=""), "stop cannot contain an empty string."),
    (dict(stop_token_ids=["a"]), "stop_token_ids must contain only integers, got ['a']."),
    (dict(stop_token_ids=[1, 2.5]), "stop_token_ids must contain only integers, got [1, 2.5]."),
    (
        dict(stop=["x"], detokenize=False),
        "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.",
    ),
    (dict(temperature=0.0, n=2), "n must be 1 when using greedy sampling, got 2."),
]


@pytest.mark.parametrize("kwargs,message", INVALID, ids=[str(k) for k, _ in INVALID])
def test_invalid_params_raise_vllm_message(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "kwargs,message",
    [
        # vLLM checks in declaration order: n before penalties before temperature before top_p ...
        (dict(n=0, top_p=0.0), "n must be at least 1, got 0."),
        (dict(temperature=-1.0, top_k=-3), "temperature must be non-negative, got -1.0."),
        (dict(top_p=2.0, min_p=3.0), "top_p must be in (0, 1], got 2.0."),
        (dict(max_tokens=0, logprobs=-1), "max_tokens must be at least 1, got 0."),
        (dict(logprobs=-1, stop=[""]), "logprobs must be non-negative, got -1."),
    ],
)
def test_validation_order(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message


def test_top_k_float_is_type_error():
    with pytest.raises(TypeError, match=r"^top_k must be an integer, got float$"):
        SamplingParams(top_k=2.5)


def test_valid_edge_values_accepted():
    assert SamplingParams(top_k=-1).top_k == -1  # vLLM quietly accepts -1 as "disabled" and keeps it
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=1).top_k == 1
    assert (SamplingParams(top_p=1.0, min_p=1.0).top_p, SamplingParams(min_p=0.0).min_p) == (1.0, 0.0)
    p = SamplingParams(min_tokens=4, max_tokens=4)
    assert (p.min_tokens, p.max_tokens) == (4, 4)
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0).presence_penalty == -2.0
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(logprobs=True, prompt_logprobs=True).logprobs == 1  # vLLM: True -> 1
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(temperature=0.0, n=1).n == 1
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=0).seed == 0


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, 0.0, 0.0, 1.0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (False, 16, 0, None, None)
    assert (p.detokenize, p.skip_special_tokens, p.spaces_between_special_tokens) == (True, True, True)
    assert p.include_stop_str_in_output is False
    assert p.output_kind == RequestOutputKind.CUMULATIVE
    assert [int(k) for k in RequestOutputKind] == [0, 1, 2]


def test_stop_normalisation():
    assert SamplingParams(stop="abc").stop == ["abc"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=[7, 9]).stop_token_ids == [7, 9]


def test_greedy_resets_top_p_top_k_min_p():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.3)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.greedy


def test_random_keeps_top_p_top_k_min_p():
    p = SamplingParams(temperature=0.7, top_p=0.5, top_k=5, min_p=0.3)
    assert (p.top_p, p.top_k, p.min_p) == (0.5, 5, 0.3)
    assert not p.greedy


def test_small_temperature_is_clamped_with_warning(caplog):
    caplog.set_level(logging.WARNING, logger="kvserve")
    logging.getLogger("kvserve").addHandler(caplog.handler)
    try:
        p = SamplingParams(temperature=0.005)
        tiny = SamplingParams(temperature=1e-6, top_k=5)  # clamped before the greedy test: random
    finally:
        logging.getLogger("kvserve").removeHandler(caplog.handler)
    assert p.temperature == 0.01 and not p.greedy
    assert tiny.temperature == 0.01 and not tiny.greedy and tiny.top_k == 5
    assert any("We have maxed it out to 0.01" in r.getMessage() for r in caplog.records)


def test_generation_config_merge_and_clone():
    p = SamplingParams(stop_token_ids=[7])
    q = p.clone()
    q.update_from_generation_config(2, [2, 5])
    assert q.eos_token_id == 2 and set(q.stop_token_ids) == {5, 7} and q.all_stop_token_ids == {2, 5, 7}
    assert p.stop_token_ids == [7] and p.all_stop_token_ids == {7}  # the clone is independent
    r = SamplingParams(ignore_eos=True)
    r.update_from_generation_config(2, [2, 5])
    # ignore_eos: EOS ids do not stop the request, but min_tokens still masks them
    assert r.eos_token_id is None and r.stop_token_ids == [] and r.all_stop_token_ids == {2, 5}


# ----------------------------------------------------------------------------------------------
# Sampler on synthetic logits
# ----------------------------------------------------------------------------------------------


def _rows(params: SamplingParams, n: int, gen: torch.Generator | None = None, num_out: int = 0):
    return [SamplingRow(params, gen, num_out) for _ in range(n)]


def _draw(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    """n independent draws from one row (n identical rows sharing a seeded generator)."""
    gen = torch.Generator().manual_seed(seed)
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    return torch.tensor([r.token_id for r in Sampler()(logits, _rows(params, n, gen))])


def test_greedy_is_argmax_ties_to_lowest_id():
    logits = torch.tensor(
        [
            [1.0, 5.0, 3.0, 5.0, 5.0],
            [7.0, 7.0, 7.0, 7.0, 7.0],
            [0.0, -1.0, 2.0, 2.0, -3.0],
            [-9.0, -2.0, -2.0, -5.0, -2.0],
        ]
    )
    res = Sampler()(logits, _rows(SamplingParams(temperature=0.0), 4))
    assert [r.token_id for r in res] == [1, 0, 2, 1]
    torch.manual_seed(0)
    rnd = torch.randn(64, 300)
    res = Sampler()(rnd, _rows(SamplingParams(temperature=0.0), 64))
    assert [r.token_id for r in res] == rnd.argmax(dim=-1).tolist()


def test_top_k_1_equals_greedy():
    torch.manual_seed(1)
    logits = torch.randn(200, 100) * 0.3  # flat logits: plain sampling would rarely hit the argmax
    gen = torch.Generator().manual_seed(5)
    res = Sampler()(logits, _rows(SamplingParams(temperature=1.5, top_k=1), 200, gen))
    assert [r.token_id for r in res] == logits.argmax(dim=-1).tolist()
    res = Sampler()(logits, _rows(SamplingParams(temperature=1.5), 200, gen))
    assert sum(r.token_id == a for r, a in zip(res, logits.argmax(dim=-1).tolist())) < 100


def _probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.softmax(logits.double() / temperature, dim=-1)


def _chi_square(draws: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    expected = probs * draws.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


LOGITS_32 = torch.linspace(2.0, -2.0, 32)[torch.randperm(32, generator=torch.Generator().manual_seed(3))]


def test_top_k_never_samples_outside_top_k():
    allowed = set(LOGITS_32.topk(5).indices.tolist())
    draws = _draw(LOGITS_32, SamplingParams(temperature=1.0, top_k=5), 4000, seed=11)
    assert set(draws.tolist()) == allowed  # inside the set, and every member is reachable
    probs = torch.zeros(32, dtype=torch.float64)
    idx = torch.tensor(sorted(allowed))
    probs[idx] = _probs(LOGITS_32[idx])
    assert _chi_square(draws, probs) < 30.0  # df = 4; wrong distributions give hundreds


def _top_p_set(logits: torch.Tensor, p: float) -> set[int]:
    """The smallest most-likely set whose mass reaches p (vLLM keeps a token when the mass strictly
    above it is < p)."""
    probs = _probs(logits)
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for t in order:
        if mass >= p:
            break
        kept.append(t)
        mass += float(probs[t])
    return set(kept)


@pytest.mark.parametrize("top_p", [0.3, 0.62, 0.9])
def test_top_p_never_samples_outside_nucleus(top_p):
    allowed = _top_p_set(LOGITS_32, top_p)
    assert 1 < len(allowed) < 32
    draws = _draw(LOGITS_32, SamplingParams(temperature=1.0, top_p=top_p), 4000, seed=12)
    assert set(draws.tolist()) == allowed


def test_min_p_never_samples_below_threshold():
    probs = _probs(LOGITS_32)
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < 32
    draws = _draw(LOGITS_32, SamplingParams(temperature=1.0, min_p=0.3), 4000, seed=13)
    assert set(draws.tolist()) == allowed
    # min_p applies to the temperature-scaled distribution (vLLM: temperature, then min_p)
    probs_t = _probs(LOGITS_32, 0.5)
    allowed_t = set(torch.nonzero(probs_t >= 0.3 * probs_t.max()).flatten().tolist())
    assert allowed_t < allowed
    draws = _draw(LOGITS_32, SamplingParams(temperature=0.5, min_p=0.3), 3000, seed=14)
    assert set(draws.tolist()) <= allowed_t


def test_combined_filters_intersect():
    allowed = set(LOGITS_32.topk(8).indices.tolist()) & _top_p_set(LOGITS_32, 0.5)
    draws = _draw(LOGITS_32, SamplingParams(temperature=1.0, top_k=8, top_p=0.5), 3000, seed=15)
    assert set(draws.tolist()) <= allowed


def test_temperature_scales_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -2.0])
    n = 6000
    tops = []
    for i, t in enumerate([0.5, 1.0, 2.0]):
        draws = _draw(logits, SamplingParams(temperature=t), n, seed=100 + i)
        # matches softmax(logits / T): chi-square with df = 4 (p = 1e-4 at 23.5) ...
        assert _chi_square(draws, _probs(logits, t)) < 30.0, t
        # ... and not the distribution of another temperature
        other = 2.0 if t != 2.0 else 0.5
        assert _chi_square(draws, _probs(logits, other)) > 200.0, t
        tops.append(float((draws == 0).double().mean()))
    assert tops[0] > tops[1] > tops[2]


def test_seeded_rows_independent_of_batch():
    torch.manual_seed(4)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, seed=123)
    other = SamplingParams(temperature=1.0)

    def run(batch_order):
        gen = torch.Generator().manual_seed(123)
        out = []
        for _ in range(30):
            rows, lg = [], []
            for kind in batch_order:
                if kind == "s":
                    rows.append(SamplingRow(params, gen, 0))
                    lg.append(logits[0])
                else:
                    rows.append(SamplingRow(other, None, 0))
                    lg.append(logits[1 + len(lg) % 2])
            res = Sampler()(torch.stack(lg), rows)
            out.append(res[batch_order.index("s")].token_id)
        return out

    alone = run(["s"])
    assert run(["o", "s", "o"]) == alone
    assert run(["o", "o", "s"]) == alone
    assert len(set(alone)) > 3  # actually random


def test_min_tokens_masks_all_stop_ids():
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10, stop_token_ids=[4])
    params.update_from_generation_config(2, [])  # EOS 2 joins the masked set
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 8.0, 0.5]] * 2)
    before = logits.clone()
    sampler = Sampler()
    for num_out in range(3):
        res = sampler(logits, [SamplingRow(params, None, num_out)])
        assert res[0].token_id == 3
    assert sampler(logits, [SamplingRow(params, None, 3)])[0].token_id == 2  # unmasked from min_tokens on
    rnd = SamplingParams(temperature=2.0, min_tokens=1, stop_token_ids=[4])
    rnd.update_from_generation_config(2, [])
    draws = _draw(logits[0], rnd, 2000, seed=9)
    assert not ({2, 4} & set(draws.tolist()))
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_logprobs_rank_order_and_values():
    torch.manual_seed(6)
    logits = torch.randn(400, 60) * 2.0
    expected = torch.log_softmax(logits, dim=-1)
    params = SamplingParams(temperature=3.0, top_k=40, logprobs=5)  # sampled token often not top-5
    gen = torch.Generator().manual_seed(21)
    res = Sampler()(logits, _rows(params, 400, gen))
    outside = 0
    for i, r in enumerate(res):
        lp = expected[i]
        assert r.logprob_token_ids[0] == r.token_id
        assert r.sampled_rank == int((lp >= lp[r.token_id]).sum())
        top_v, top_i = lp.topk(5)
        assert r.logprob_token_ids[1:] == top_i.tolist()
        # values: log_softmax of the RAW logits (not temperature / top-k processed)
        assert r.logprobs == pytest.approx([float(lp[t]) for t in r.logprob_token_ids], abs=1e-5)
        assert r.logprobs[1:] == sorted(r.logprobs[1:], reverse=True)
        outside += r.sampled_rank > 5
    assert outside > 50
    res0 = Sampler()(logits[:3], _rows(SamplingParams(temperature=0.0, logprobs=0), 3))
    for i, r in enumerate(res0):
        assert r.logprob_token_ids == [r.token_id] and r.sampled_rank == 1
    res_none = Sampler()(logits[:2], _rows(SamplingParams(temperature=0.0), 2))
    assert all(r.logprob_token_ids is None and r.logprobs is None for r in res_none)


def test_logprobs_are_raw_even_with_min_tokens_mask():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], logprobs=2)
    logits = torch.tensor([[0.0, 5.0, 1.0, -1.0]])
    r = Sampler()(logits, [SamplingRow(params, None, 0)])[0]
    assert r.token_id == 2
    lp = torch.log_softmax(logits[0], dim=-1)
    assert r.logprob_token_ids == [2, 1, 2] and r.sampled_rank == 2
    assert r.logprobs == pytest.approx([float(lp[2]), float(lp[1]), float(lp[2])])


def test_penalties_follow_vllm_formulas():
    """repetition: seen (prompt or output) logits divided if > 0 else multiplied; frequency:
    minus penalty x output count; presence: minus penalty if in output. Raw logprobs unchanged."""
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0, -1.05]])

    def pick(prompt, output, **kw):
        p = SamplingParams(temperature=0.0, logprobs=1, **kw)
        r = Sampler()(logits, [SamplingRow(p, None, len(output), prompt, output)])[0]
        return r.token_id, r.logprobs[0]

    assert pick([], [0, 0])[0] == 0
    assert pick([], [0, 0], frequency_penalty=0.1)[0] == 1  # 3.0 - 2 * 0.1 < 2.9
    assert pick([], [0], frequency_penalty=0.05)[0] == 0  # 2.95 > 2.9
    assert pick([], [0, 0, 0], presence_penalty=0.05)[0] == 0  # presence does not count
    assert pick([], [0], presence_penalty=0.2)[0] == 1
    assert pick([0], [], repetition_penalty=1.1)[0] == 1  # prompt tokens count: 3.0 / 1.1 < 2.9
    assert pick([], [0], repetition_penalty=1.01)[0] == 0  # 2.97 > 2.9
    assert pick([], [], presence_penalty=1.0, frequency_penalty=1.0, repetition_penalty=2.0)[0] == 0
    raw = float(torch.log_softmax(logits[0], -1)[1])
    assert pick([], [0, 0], frequency_penalty=0.1)[1] == pytest.approx(raw)
    # negative logits are multiplied: -1.0 * 1.1 < -1.05
    neg = torch.tensor([[-1.0, -1.05]])
    p = SamplingParams(temperature=0.0, repetition_penalty=1.1)
    assert Sampler()(neg, [SamplingRow(p, None, 1, [], [0])])[0].token_id == 1


# ----------------------------------------------------------------------------------------------
# End to end on a tiny model
# ----------------------------------------------------------------------------------------------

PROMPTS = ["The quick brown fox", "Paged attention stores", "def main():", "Le cœur a ses raisons"]


@pytest.fixture(scope="module")
def llm(make_tiny_model):
    return LLM(str(make_tiny_model("llama")), kv_cache_memory=1 << 24)


def _gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def _ids(out):
    return list(out.outputs[0].token_ids)


def test_seeded_request_reproducible_across_calls_and_batches(llm):
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=16, ignore_eos=True)
    free = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    ref = _ids(_gen(llm, [PROMPTS[0]], seeded)[0])
    assert len(ref) == 16 and len(set(ref)) > 4
    assert _ids(_gen(llm, [PROMPTS[0]], seeded)[0]) == ref
    outs = _gen(llm, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [free, seeded, free])
    assert _ids(outs[1]) == ref
    outs = _gen(llm, [PROMPTS[0], PROMPTS[3], PROMPTS[2]], [seeded, free, free])
    assert _ids(outs[0]) == ref
    other_seed = SamplingParams(temperature=1.0, seed=124, max_tokens=16, ignore_eos=True)
    assert _ids(_gen(llm, [PROMPTS[0]], other_seed)[0]) != ref
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a, b = (_ids(o) for o in _gen(llm, [PROMPTS[0], PROMPTS[0]], unseeded))
    c = _ids(_gen(llm, [PROMPTS[0]], unseeded)[0])
    assert len({tuple(a), tuple(b), tuple(c)}) == 3


@pytest.fixture(scope="module")
def greedy_ref(llm):
    """Greedy continuation of PROMPTS[0] (24 tokens, EOS ignored): ids and text."""
    out = _gen(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    return out.outputs[0]


def _first_new_position(ids: list[int], start: int) -> int:
    """A position >= start whose id does not occur earlier (so it cannot stop the run sooner)."""
    for k in range(start, len(ids)):
        if ids[k] not in ids[:k]:
            return k
    pytest.skip("greedy continuation too repetitive")


def test_max_tokens_length_finish(llm, greedy_ref):
    out = _gen(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    c = out.outputs[0]
    assert list(c.token_ids) == list(greedy_ref.token_ids[:5])
    assert (c.finish_reason, c.stop_reason) == ("length", None)
    assert out.finished


def test_stop_token_ids(llm, greedy_ref):
    ids = list(greedy_ref.token_ids)
    k = _first_new_position(ids, 3)
    stop_id = ids[k]
    out = _gen(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id]))[0]
    c = out.outputs[0]
    assert list(c.token_ids) == ids[: k + 1]  # the stop id stays in token_ids
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    before = _gen(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True))[0]
    upto = _gen(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=k + 1, ignore_eos=True))[0]
    assert c.text == before.outputs[0].text  # the stop token's text is left out ...
    kept = _gen(
        llm,
        [PROMPTS[0]],
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == upto.outputs[0].text  # ... unless include_stop_str_in_output
    assert kept.stop_reason == stop_id


def test_min_tokens_defers_stop_token(llm, greedy_ref):
    ids = list(greedy_ref.token_ids)
    k = _first_new_position(ids, 1)
    stop_id = ids[k]
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=k + 6, stop_token_ids=[stop_id])
    c = _gen(llm, [PROMPTS[0]], params)[0].outputs[0]
    toks = list(c.token_ids)
    assert len(toks) >= k + 6
    assert toks[:k] == ids[:k] and toks[k] != stop_id  # masked: greedy takes the runner-up
    eos = llm.get_tokenizer().eos_token_id
    assert stop_id not in toks[: k + 6] and eos not in toks[: k + 6]
    if c.finish_reason == "stop":
        assert toks[-1] in (stop_id, eos) and len(toks) > k + 6
    else:
        assert c.finish_reason == "length" and len(toks) == 20


def test_eos_stop_ignore_eos_and_min_tokens(llm, greedy_ref):
    """Pretend the model's EOS is an id the greedy run emits early (engine-level EOS)."""
    ids = list(greedy_ref.token_ids)
    k = _first_new_position(ids, 2)
    engine = llm.llm_engine
    saved = engine.eos_token_id
    engine.eos_token_id = ids[k]
    try:
        c = _gen(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0]
        assert list(c.token_ids) == ids[: k + 1]  # EOS is kept in token_ids
        assert (c.finish_reason, c.stop_reason) == ("stop", None)  # stop_reason None for EOS
        c = _gen(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
        assert list(c.token_ids) == ids and c.finish_reason == "length"
        c = _gen(llm, [PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=k + 3))[0].outputs[0]
        assert len(c.token_ids) >= k + 3 and ids[k] not in list(c.token_ids)[: k + 3]
    finally:
        engine.eos_token_id = saved


def _pick_stop_string(text: str, start: int = 3) -> tuple[str, int]:
    for i in range(start, len(text) - 2):
        s = text[i : i + 2]
        if s.isprintable() and "\ufffd" not in s and text.find(s) == i:
            return s, i
    pytest.skip("no usable stop string in the greedy text")


def test_stop_strings(llm, greedy_ref):
    text = greedy_ref.text
    stop, idx = _pick_stop_string(text)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["\u2603never\u2603", stop])
    c = _gen(llm, [PROMPTS[0]], params)[0].outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == text[:idx]  # cut before the stop string
    toks = list(c.token_ids)
    assert toks == list(greedy_ref.token_ids[: len(toks)]) and len(toks) < 24  # ids are not cut
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    c = _gen(llm, [PROMPTS[0]], params)[0].outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == text[: idx + len(stop)]
    # a stop string is not looked for in the text of the first min_tokens tokens
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24, ignore_eos=True, stop=[stop])
    c = _gen(llm, [PROMPTS[0]], params)[0].outputs[0]
    assert c.finish_reason == "length" and c.text == text


def test_logprobs_end_to_end(llm):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=3)
    c = _gen(llm, [PROMPTS[1]], params)[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 8
    total = 0.0
    for tok, entry in zip(c.token_ids, c.logprobs):
        keys = list(entry)
        assert keys[0] == tok and len(entry) in (3, 4)  # sampled first; merged when inside the top 3
        by_value = sorted(entry.values(), key=lambda lp: -lp.logprob)
        assert [lp.rank for lp in by_value[:3]] == [1, 2, 3]
        if len(entry) == 4:
            assert entry[tok].rank >= 4 and by_value[3] is entry[tok]
        assert all(v.logprob <= 0.0 for v in entry.values())
        total += entry[tok].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert not math.isnan(c.cumulative_logprob)


def test_runner_passes_token_ids_for_penalties(llm, monkeypatch):
    rows_seen = []
    original = Sampler.__call__

    def spy(self, logits, rows):
        for r in rows:  # snapshot: the runner may hand over live lists
            ids = (r.prompt_token_ids, r.output_token_ids)
            rows_seen.append((r.params, *(None if x is None else list(x) for x in ids)))
        return original(self, logits, rows)

    monkeypatch.setattr(Sampler, "__call__", spy)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, repetition_penalty=1.5)
    out = _gen(llm, [PROMPTS[0]], params)[0]
    rows = [(p, o) for params, p, o in rows_seen if params.repetition_penalty == 1.5]
    assert len(rows) == 3
    assert all(p == list(out.prompt_token_ids) for p, _ in rows)
    assert [o for _, o in rows] == [list(out.outputs[0].token_ids[:i]) for i in range(3)]


def test_penalties_change_greedy_output_end_to_end(llm):
    """On a prompt whose greedy output repeats one token, each penalty breaks the repetition. The
    prompt is searched among 32 token-id prompts (the tiny model is the same on every machine)."""
    candidates = [{"prompt_token_ids": [(37 * i + 11 * j) % 500 + 3 for j in range(6)]} for i in range(32)]
    outs = _gen(llm, candidates, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    prompt, base = max(zip(candidates, map(_ids, outs)), key=lambda cb: max(map(cb[1].count, cb[1])))
    top = max(set(base), key=base.count)
    assert base.count(top) >= 6  # the unpenalized model loops on one token
    for kw in ({"repetition_penalty": 2.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        pen = _ids(_gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw))[0])
        assert pen != base, kw
        assert pen.count(top) <= 2, (kw, pen)


def test_out_of_vocab_stop_token_id_rejected(llm):
    vocab = llm.llm_engine.vocab_size
    with pytest.raises(ValueError, match=rf"token_id\(s\) \[{vocab}\] in stop_token_ids contain out-of-vocab token ids"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, stop_token_ids=[vocab]), use_tqdm=False)
