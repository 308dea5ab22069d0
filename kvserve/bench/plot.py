"""The ``--sweep-concurrency --plot`` chart: throughput and median latencies vs concurrency (PNG, Agg)."""

from __future__ import annotations

import os
from typing import Any


def check_plot_path(path: str) -> None:
    """Fail before the benchmark when the chart cannot be written."""
    if not str(path).lower().endswith(".png"):
        raise ValueError(f"--plot {path!r} is invalid: expected a .png file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--plot {path!r} is invalid: folder {folder!r} does not exist")


def plot_sweep(records: list[dict[str, Any]], path: str) -> None:
    """Three panels over concurrency: output tok/s and request/s, median TTFT, median TPOT and ITL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [r["max_concurrency"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    ax.plot(conc, [r["output_throughput"] for r in records], "o-", label="output tok/s")
    ax.plot(conc, [r["total_token_throughput"] for r in records], "s--", label="total tok/s")
    ax.set_title("Throughput")
    ax.set_ylabel("tokens / s")
    ax.legend()
    ax = axes[1]
    ax.plot(conc, [r["median_ttft_ms"] for r in records], "o-", color="tab:orange", label="median TTFT")
    if "p99_ttft_ms" in records[0]:
        ax.plot(conc, [r["p99_ttft_ms"] for r in records], "^:", color="tab:orange", alpha=0.6, label="P99 TTFT")
    ax.set_title("Time to first token")
    ax.set_ylabel("ms")
    ax.legend()
    ax = axes[2]
    ax.plot(conc, [r["median_tpot_ms"] for r in records], "o-", color="tab:green", label="median TPOT")
    ax.plot(conc, [r["median_itl_ms"] for r in records], "s--", color="tab:red", label="median ITL")
    ax.set_title("Time per output token")
    ax.set_ylabel("ms")
    ax.legend()
    for ax in axes:
        ax.set_xlabel("max concurrency")
        if len(conc) > 1 and min(conc) > 0 and max(conc) / min(conc) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(conc)
        ax.set_xticklabels([str(c) for c in conc])
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    r0 = records[0]
    fig.suptitle(f"{r0.get('model_id')} @ {r0.get('base_url')}{r0.get('endpoint')}: input {r0.get('input_len')}, "
                 f"output {r0.get('output_len')}, {r0.get('num_prompts')} prompts, rate {r0.get('request_rate')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
