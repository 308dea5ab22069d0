"""The ``kvserve`` command: generate, chat, parity, serve, traffic, bench serve, bench throughput."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvserve.arg_utils import add_engine_args, engine_kwargs


def _sampling_params(args: argparse.Namespace, **overrides: Any) -> Any:
    from kvserve import SamplingParams

    kw = dict(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    kw.update(overrides)
    return SamplingParams(**kw)


def _add_sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=temperature)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve import LLM

    params = _sampling_params(args)  # validate before loading the model
    llm = LLM(**engine_kwargs(args))
    if args.chat:
        prompts = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": p}])} for p in args.prompt]
    else:
        prompts = list(args.prompt)
    outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    for prompt, out in zip(args.prompt, outputs):
        c = out.outputs[0]
        if args.json:
            rec = {
                "prompt": prompt,
                "prompt_token_ids": out.prompt_token_ids,
                "output_token_ids": list(c.token_ids),
                "text": c.text,
                "finish_reason": c.finish_reason,
            }
            print(json.dumps(rec, ensure_ascii=False), flush=True)
        else:
            print(f"\n>>> {prompt}\n{c.text}\n[finish_reason={c.finish_reason}, {len(c.token_ids)} tokens]", flush=True)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from kvserve.entrypoints.chat import run_chat

    return run_chat(args, engine_kwargs(args), _sampling_params(args))


def cmd_parity(args: argparse.Namespace) -> int:
    from kvserve.tools import parity

    kw = engine_kwargs(args)
    bounds = dict(min_agree=args.min_agree, max_p50=args.max_p50, max_p90=args.max_p90)
    if not args.teacher_forced:
        if any(v is not None for v in bounds.values()):
            raise ValueError("--min-agree, --max-p50 and --max-p90 apply only with --teacher-forced")
        rows = parity.run_parity(args.prompts, args.reference, kw, args.max_tokens, args.tie_margin)
        print(parity.format_table(rows))
        line = parity.summary_line(rows)
        print(line, flush=True)
        return 0 if all(r.status != "diverged" for r in rows) else 1
    tf_rows = parity.run_teacher_forced(args.prompts, args.reference, kw)
    summary = parity.summarize_teacher_forced(tf_rows)
    print(parity.format_teacher_forced_table(tf_rows))
    print(parity.format_teacher_forced_overall(summary))
    failed = parity.check_bounds(summary, **bounds)
    for msg in failed:
        print(f"bound failed: {msg}")
    print(parity.teacher_forced_line(summary), flush=True)
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: a paged-KV LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate completions for prompts")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="wrap prompts in the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_args(p)
    _add_sampling_args(p, temperature=0.0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal (streams tokens)")
    p.add_argument("--system", default=None, help="system message")
    add_engine_args(p)
    _add_sampling_args(p, temperature=0.7)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("parity", help="greedy token exactness (or teacher-forced logprobs) against a reference file")
    p.add_argument("--prompts", required=True)
    p.add_argument("--reference", required=True)
    p.add_argument("--tie-margin", type=float, default=0.01, help="greedy mode: reference gap below which a divergence is a near-tie")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy mode: tokens generated per prompt")
    p.add_argument("--teacher-forced", action="store_true",
                   help="feed prompt + reference output as one prompt; compare prompt logprobs of the reference tokens")
    p.add_argument("--min-agree", type=float, default=None,
                   help="teacher-forced bound: least fraction of steps whose top-1 is the reference token (e.g. 0.98)")
    p.add_argument("--max-p50", type=float, default=None, help="teacher-forced bound: largest p50 of |delta logprob|")
    p.add_argument("--max-p90", type=float, default=None, help="teacher-forced bound: largest p90 of |delta logprob|")
    add_engine_args(p)
    p.set_defaults(func=cmd_parity)
    from kvserve.bench import add_parser as add_bench_parser
    from kvserve.entrypoints.openai.serve import add_parser as add_serve_parser
    from kvserve.tools.traffic import add_parser as add_traffic_parser

    add_serve_parser(sub)
    add_traffic_parser(sub)
    add_bench_parser(sub)
    _add_bench_throughput_parser(sub)
    return parser


def _add_bench_throughput_parser(sub: Any) -> None:
    """``kvserve bench throughput`` next to ``bench serve``: the same ``bench`` sub-commands."""
    from kvserve.bench.throughput import add_parser as add_throughput_parser

    bench = sub.choices["bench"]
    bench_sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    add_throughput_parser(bench_sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        sys.stdout.flush()
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\nkvserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
