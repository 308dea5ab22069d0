"""``kvserve parity``: greedy token exactness of the engine against a reference file.

Prompts (``{"id", "prompt_token_ids", ...}``) run greedily in one batch; each output is compared
with the reference record of the same id (``{"id", "output_token_ids", "top_logprobs", ...}``).
A divergence whose reference logprob gap (its token vs ours, at that step) is below the tie
margin is a near-tie; anything else is diverged."""

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
