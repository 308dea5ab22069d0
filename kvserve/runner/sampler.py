"""Sampler: min_tokens, penalties, temperature, min_p, top-k, top-p, seeded sampling, logprobs
(vLLM V1 order: raw logprobs first, then min_tokens masking and penalties on every row, then, for
random rows only, temperature, min_p, top-k/top-p and the exponential-race draw)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.sampling import SamplingParams
from kvserve.logger import init_logger
from kvserve.runner.transfer import rows_to_device, to_device

logger = init_logger(__name__)


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    num_output_tokens: int
    # needed only for presence/frequency (output ids) and repetition (prompt + output ids)
    # penalties; a row with non-default penalties but without these ids is sampled unpenalized
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        p = self.params
        self.has_penalties = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
        # what the fused kernel does (greedy or plain temperature), min_tokens aside (it changes per step)
        self.fused_ok = (
            p.logprobs is None and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 and not self.has_penalties
        )


@dataclass(slots=True)
class SampleResult:
    token_id: int
    # [sampled, top-1, ..., top-N] ids and their raw log-probabilities, None when not requested
    logprob_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    sampled_rank: int | None = None


def _apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside the top-k / top-p sets (k = 0 or p = 1 leave a row as it is)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if k is not None:
        kk = torch.where(k > 0, k, torch.full_like(k, vocab)).clamp(max=vocab)
        kth = sorted_logits.gather(1, (vocab - kk).unsqueeze(1).long())
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        mask = cum <= (1 - p).unsqueeze(1)
        mask[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: list[int], num: int
) -> list[tuple[list[int], list[float], int]]:
    """Per row: ([token, top-1..top-num] ids, their logprobs, the token's rank) — vLLM's layout;
    rank counts the vocabulary entries whose logprob is >= the token's."""
    tok = torch.tensor(token_ids, device=logprobs.device)
    tok_lp = logprobs.gather(1, tok.unsqueeze(1))
    ranks = (logprobs >= tok_lp).sum(dim=1).tolist()
    tok_vals = tok_lp.squeeze(1).tolist()
    if num > 0:
        top_v, top_i = logprobs.topk(num, dim=1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    rows = []
    for r, t in enumerate(token_ids):
        ids, vals = [t], [tok_vals[r]]
        if num > 0:
            ids += top_i[r]
            vals += top_v[r]
        rows.append((ids, vals, ranks[r]))
    return rows


def _token_counts(ids: list[int] | None, vocab: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(vocab + 1, dtype=torch.float32, device=device)
    if ids:
        t = torch.tensor(ids, dtype=torch.long, device=device).clamp(0, vocab)  # out of vocab -> pad bin
        counts.scatter_add_(0, t, torch.ones_like(t, dtype=torch.float32))
    return counts[:vocab]


def _apply_penalties(row_logits: torch.Tensor, r: SamplingRow) -> None:
    """vLLM's ``apply_penalties`` on one row, in place: repetition penalty on every token seen in
    the prompt or the output (divide positive logits, multiply negative ones), then OpenAI's
    frequency (x output count) and presence (x seen in output) penalties."""
    vocab, dev, p = row_logits.shape[-1], row_logits.device, r.params
    out_counts = _token_counts(r.output_token_ids, vocab, dev)
    out_mask = out_counts > 0
    if p.repetition_penalty != 1.0:
        seen = out_mask | (_token_counts(r.prompt_token_ids, vocab, dev) > 0)
        pen = torch.where(seen, torch.full_like(row_logits, p.repetition_penalty), torch.ones_like(row_logits))
        row_logits.copy_(torch.where(row_logits > 0, row_logits / pen, row_logits * pen))
    if p.frequency_penalty != 0.0:
        row_logits.sub_(p.frequency_penalty * out_counts)
    if p.presence_penalty != 0.0:
        row_logits.sub_(p.presence_penalty * out_mask.float())


class Sampler:
    """``fused`` (set by the runner on CUDA): rows that need temperature only are sampled by one
    Triton kernel (``kernels/triton_sampling.py``); any other row sends the batch down the torch path."""

    def __init__(self, fused: bool = False) -> None:
        self.fused = fused

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        tokens, raw_logprobs = self.sample_tokens(logits, rows)
        token_list = tokens.tolist()
        results = [SampleResult(t) for t in token_list]
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                n = r.params.logprobs
                if n is not None:
                    (ids, vals, rank), = gather_logprobs(raw_logprobs[i : i + 1], [token_list[i]], n)
                    results[i].logprob_token_ids, results[i].logprobs, results[i].sampled_rank = ids, vals, rank
        return results

    def sample_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled token of every row, on the logits' device (no host synchronisation), and
        the raw logprobs when a row asks for them."""
        if self.fused and rows and all(_temperature_only(r) for r in rows):
            try:
                return self._sample_fused(logits, rows), None
            except Exception as e:  # a Triton build without the kernel's features: keep serving
                logger.warning("Fused sampling kernel unavailable (%s: %s); using torch's sampling ops",
                               type(e).__name__, e)
                self.fused = False
        src = logits
        logits = logits.float()
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        vocab = logits.shape[-1]
        for i, r in enumerate(rows):
            mask_stop = r.num_output_tokens < r.params.min_tokens and r.params.all_stop_token_ids
            penalize = r.has_penalties and (r.prompt_token_ids is not None or r.output_token_ids is not None)
            if (mask_stop or penalize) and logits is src:
                logits = logits.clone()  # never modify the caller's tensor
            if mask_stop:
                stop_ids = [t for t in r.params.all_stop_token_ids if 0 <= t < vocab]
                logits[i, stop_ids] = float("-inf")
            if penalize:
                _apply_penalties(logits[i], r)

        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        all_random = bool(rows) and len(random_rows) == len(rows)
        # greedy rows (ties: lowest id, as vLLM); skipped when every row samples
        tokens = None if all_random else logits.argmax(dim=-1)
        if random_rows:
            dev = logits.device
            params = [rows[i].params for i in random_rows]
            idx = None if all_random else to_device(random_rows, torch.long, dev)
            sub = logits if idx is None else logits[idx]  # not modified in place below
            # per-row values go to the device in one copy each; which steps apply is decided on the host
            temps = to_device([p.temperature for p in params], torch.float32, dev)
            sub = sub / temps.unsqueeze(1)
            if any(p.min_p > 0 for p in params):
                min_p = to_device([p.min_p for p in params], torch.float32, dev)
                probs = sub.softmax(dim=-1)
                thresh = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
                sub = sub.masked_fill(probs < thresh, float("-inf"))
            use_k, use_p = any(p.top_k > 0 for p in params), any(p.top_p < 1 for p in params)
            if use_k or use_p:
                k = to_device([p.top_k for p in params], torch.long, dev) if use_k else None
                top_p = to_device([p.top_p for p in params], torch.float32, dev) if use_p else None
                sub = _apply_top_k_top_p(sub, k, top_p)
            probs = sub.softmax(dim=-1)
            # exponential race: unseeded rows share one draw; a seeded row draws from its generator
            q = torch.empty_like(probs).exponential_()
            for j, i in enumerate(random_rows):
                if rows[i].generator is not None:
                    q[j].exponential_(generator=rows[i].generator)
            picked = probs.div_(q).argmax(dim=-1)
            if idx is None:
                tokens = picked
            else:
                assert tokens is not None
                tokens[idx] = picked

        assert tokens is not None
        return tokens, raw_logprobs

    def _sample_fused(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature-only rows in one kernel: unseeded rows share a key drawn from torch's
        global generator (the engine seed makes it repeatable), each from its own counter range;
        a seeded row's key mixes its seed and output position."""
        from kvserve.kernels.triton_sampling import gumbel_argmax, seeded_key

        vocab = logits.shape[-1]
        step_key = int(torch.randint(0, 2**31 - 1, (1,)).item())
        temps = [0.0 if r.params.greedy else r.params.temperature for r in rows]
        keys, counters = [step_key] * len(rows), list(range(0, len(rows) * vocab, vocab))
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                keys[i], counters[i] = seeded_key(r.params.seed, r.num_output_tokens), 0
        dev = logits.device
        keys_t, counters_t = rows_to_device((keys, counters), torch.int32, dev)
        return gumbel_argmax(logits, to_device(temps, torch.float32, dev), keys_t, counters_t)


def _temperature_only(r: SamplingRow) -> bool:
    """Greedy or plain temperature sampling: nothing that the fused kernel does not do."""
    return r.fused_ok and not (r.num_output_tokens < r.params.min_tokens and r.params.all_stop_token_ids)
