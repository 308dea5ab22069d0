"""``kvserve parity``: the engine against a reference file.

Greedy mode (default): token exactness. Prompts (``{"id", "prompt_token_ids", ...}``) run greedily
in one batch; each output is compared with the reference record of the same id (``{"id",
"output_token_ids", "top_logprobs", ...}``). A divergence whose reference logprob gap (its token vs
ours, at that step) is below the tie margin is a near-tie; anything else is diverged.

Teacher-forced mode (``--teacher-forced``): each prompt plus the reference's output tokens is one
prompt; kvserve's prompt logprobs give, at every reference step, the |delta logprob| of the
reference token and whether it is kvserve's top-1. Statistics are pure functions of
``TeacherForcedRow`` records (``summarize_teacher_forced``, ``check_bounds``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class ParityRow:
    id: str
    status: str  # "match" | "near-tie" | "diverged"
    ref_len: int
    our_len: int
    diverge_at: int | None = None
    gap: float | None = None  # reference logprob of its token minus ours (None: ours not in its top-k)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def compare(rid: str, ours: list[int], ref: dict[str, Any], tie_margin: float) -> ParityRow:
    theirs = ref["output_token_ids"]
    row = ParityRow(rid, "match", len(theirs), len(ours))
    if ours == theirs:
        return row
    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    row.diverge_at = i
    top = ref.get("top_logprobs") or []
    if i < len(top) and i < len(ours):
        table = {int(t): float(lp) for t, lp in top[i]}
        ref_lp = table.get(theirs[i]) if i < len(theirs) else None
        if ref_lp is not None and ours[i] in table:
            row.gap = ref_lp - table[ours[i]]
    row.status = "near-tie" if row.gap is not None and row.gap < tie_margin else "diverged"
    return row


def format_table(rows: list[ParityRow]) -> str:
    lines = [f"{'id':<34} {'result':<9} {'ref':>4} {'ours':>4} {'diverge@':>8} {'ref gap':>9}"]
    for r in rows:
        at = "-" if r.diverge_at is None else str(r.diverge_at)
        gap = "-" if r.gap is None else f"{r.gap:.4f}"
        if r.status != "match" and r.gap is None:
            gap = ">top-k"
        lines.append(f"{r.id:<34} {r.status:<9} {r.ref_len:>4} {r.our_len:>4} {at:>8} {gap:>9}")
    return "\n".join(lines)


def summary_line(rows: list[ParityRow]) -> str:
    m = sum(r.status == "match" for r in rows)
    t = sum(r.status == "near-tie" for r in rows)
    d = sum(r.status == "diverged" for r in rows)
    return f"parity: {m}/{len(rows)} exact, {t} near-tie, {d} diverged"


def run_parity(
    prompts_path: str,
    reference_path: str,
    llm_kwargs: dict[str, Any],
    max_tokens: int = 64,
    tie_margin: float = 0.01,
) -> list[ParityRow]:
    from kvserve import LLM, SamplingParams

    prompts = read_jsonl(prompts_path)
    refs = {r["id"]: r for r in read_jsonl(reference_path)}
    missing = [p["id"] for p in prompts if p["id"] not in refs]
    if missing:
        raise ValueError(f"reference {reference_path} has no record for prompt ids {missing}")
    llm = LLM(**llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts], params)
    return [compare(p["id"], list(o.outputs[0].token_ids), refs[p["id"]], tie_margin) for p, o in zip(prompts, outs)]


# --- teacher-forced mode -------------------------------------------------------------------------
# Each prompt plus the reference's output tokens runs as one prompt (prompt logprobs, one generated
# token that is discarded). Step i of a prompt is the reference's output token i (a final EOS
# included): kvserve's prompt logprob of that token is compared with the reference's logprob of it,
# and the step agrees when that token is kvserve's top-1 there (an exact tie with the top-1 counts
# as agreement, whatever order the tie is broken in).


@dataclass
class TeacherForcedRow:
    id: str
    deltas: list[float]  # |our logprob - reference logprob| of the reference token, per step
    agrees: list[bool]  # the reference token is our top-1 (ties included), per step

    @property
    def steps(self) -> int:
        return len(self.deltas)

    @property
    def agree(self) -> int:
        return sum(self.agrees)

    @property
    def mean_delta(self) -> float:
        return sum(self.deltas) / len(self.deltas) if self.deltas else 0.0

    @property
    def max_delta(self) -> float:
        return max(self.deltas, default=0.0)


@dataclass
class TeacherForcedSummary:
    steps: int
    agree: int
    mean: float
    max: float
    p50: float
    p90: float
    p99: float

    @property
    def agree_rate(self) -> float:
        return self.agree / self.steps if self.steps else 1.0


def reference_logprobs(ref: dict[str, Any]) -> list[float]:
    """The reference's logprob of each of its output tokens: the token's entry in ``top_logprobs[i]``
    (entry 0 in a well-formed file; entry 0 is used when the token is not listed at all)."""
    ids, tops = ref["output_token_ids"], ref.get("top_logprobs")
    if not tops or len(tops) < len(ids):
        raise ValueError(
            f"reference record {ref.get('id')!r} needs top_logprobs for each of its {len(ids)} output "
            f"tokens (has {len(tops or [])})"
        )
    out = []
    for tok, top in zip(ids, tops):
        table = {int(t): float(lp) for t, lp in top}
        out.append(table.get(int(tok), float(top[0][1])))
    return out


def teacher_forced_row(
    rid: str, ref_logprobs: list[float], our_logprobs: list[float], our_top1: list[float]
) -> TeacherForcedRow:
    """Per step: our logprob of the reference token, our top-1 logprob there, the reference's logprob."""
    if not len(ref_logprobs) == len(our_logprobs) == len(our_top1):
        raise ValueError(f"{rid}: step counts differ ({len(ref_logprobs)}, {len(our_logprobs)}, {len(our_top1)})")
    deltas = [abs(o - r) for o, r in zip(our_logprobs, ref_logprobs)]
    agrees = [o >= t for o, t in zip(our_logprobs, our_top1)]
    return TeacherForcedRow(rid, deltas, agrees)


def summarize_teacher_forced(rows: list[TeacherForcedRow]) -> TeacherForcedSummary:
    """Over all steps of all prompts; percentiles are numpy's default (linear interpolation)."""
    import numpy as np

    deltas = np.asarray([d for r in rows for d in r.deltas], dtype=np.float64)
    agree = sum(r.agree for r in rows)
    if deltas.size == 0:
        return TeacherForcedSummary(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
    p50, p90, p99 = (float(x) for x in np.percentile(deltas, [50, 90, 99]))
    return TeacherForcedSummary(int(deltas.size), agree, float(deltas.mean()), float(deltas.max()), p50, p90, p99)


def check_bounds(
    s: TeacherForcedSummary,
    min_agree: float | None = None,
    max_p50: float | None = None,
    max_p90: float | None = None,
) -> list[str]:
    """The bounds that fail (empty: all given bounds hold; bounds left as None are not checked)."""
    failed = []
    if min_agree is not None and not s.agree_rate >= min_agree:
        failed.append(f"agreement {s.agree_rate:.4f} < --min-agree {min_agree:g}")
    if max_p50 is not None and not s.p50 <= max_p50:
        failed.append(f"p50 {s.p50:.1e} > --max-p50 {max_p50:g}")
    if max_p90 is not None and not s.p90 <= max_p90:
        failed.append(f"p90 {s.p90:.1e} > --max-p90 {max_p90:g}")
    return failed


def format_teacher_forced_table(rows: list[TeacherForcedRow]) -> str:
    lines = [f"{'id':<34} {'steps':>5} {'agree':>5} {'mean |d|':>9} {'max |d|':>9}"]
    for r in rows:
        lines.append(f"{r.id:<34} {r.steps:>5} {r.agree:>5} {r.mean_delta:>9.1e} {r.max_delta:>9.1e}")
    return "\n".join(lines)


def format_teacher_forced_overall(s: TeacherForcedSummary) -> str:
    return (
        f"overall: {s.agree}/{s.steps} steps agree ({100 * s.agree_rate:.1f}%), |d| mean {s.mean:.1e}, "
        f"max {s.max:.1e}, p50 {s.p50:.1e}, p90 {s.p90:.1e}, p99 {s.p99:.1e}"
    )


def teacher_forced_line(s: TeacherForcedSummary) -> str:
    return f"teacher-forced: {s.agree}/{s.steps} steps agree, p50 {s.p50:.1e}, p90 {s.p90:.1e}, p99 {s.p99:.1e}"


def run_teacher_forced(prompts_path: str, reference_path: str, llm_kwargs: dict[str, Any]) -> list[TeacherForcedRow]:
    from kvserve import LLM, SamplingParams

    prompts = read_jsonl(prompts_path)
    refs = {r["id"]: r for r in read_jsonl(reference_path)}
    missing = [p["id"] for p in prompts if p["id"] not in refs]
    if missing:
        raise ValueError(f"reference {reference_path} has no record for prompt ids {missing}")
    ref_lps = [reference_logprobs(refs[p["id"]]) for p in prompts]  # validate before loading the model
    inputs = [list(p["prompt_token_ids"]) + [int(t) for t in refs[p["id"]]["output_token_ids"]] for p in prompts]
    llm = LLM(**llm_kwargs)
    # prompt_logprobs=1: each position carries the reference token's logprob and our top-1.
    # Requests that ask for prompt logprobs skip the prefix-cache lookup (as in vLLM), so every
    # position is computed; checked below all the same.
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in inputs], params)
    rows = []
    for p, ids, ref_lp, out in zip(prompts, inputs, ref_lps, outs):
        n_prompt = len(p["prompt_token_ids"])
        plp = out.prompt_logprobs
        if plp is None or len(plp) != len(ids) or (out.num_cached_tokens or 0) > 0:
            raise RuntimeError(
                f"{p['id']}: incomplete prompt logprobs ({0 if plp is None else len(plp)} of {len(ids)} "
                f"positions, {out.num_cached_tokens} cached tokens)"
            )
        ours, top1 = [], []
        for pos in range(n_prompt, len(ids)):
            entry = plp[pos]
            if entry is None or ids[pos] not in entry:
                raise RuntimeError(f"{p['id']}: no prompt logprob at position {pos}")
            ours.append(entry[ids[pos]].logprob)
            top1.append(max(lp.logprob for lp in entry.values()))
        rows.append(teacher_forced_row(p["id"], ref_lp, ours, top1))
    return rows
