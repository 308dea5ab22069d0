"""What every benchmark of the suite shares: the run record at the top of each JSON (date, commit,
command, GPU, library versions), the JSON writer, the one summary line ``gpu.sh`` prints, and the
median of timed eager calls (``median_ms``).

Not a benchmark itself; the scripts beside it import it (``benchmarks/`` is put on ``sys.path``
by ``import common`` from a script in this folder)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CONFIGS = REPO / "benchmarks" / "configs"
if str(REPO) not in sys.path:  # the device machine runs the repository without installing it
    sys.path.insert(0, str(REPO))

# the smoke runs' model: a tiny Qwen3 (the dense attention path of the real benchmark models)
TINY_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "bos_token_id": 1,
    "eos_token_id": 2, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 512, "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "vocab_size": 512,
}
# a tiny Llama (SmolLM2's architecture) for CPU smoke runs with random fp32 weights
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.2,
    "torch_dtype": "float32",
}


def with_random_weights(folder: Path | None, config: dict | None, work: Path) -> Path:
    """A checkpoint folder under ``work``: ``folder``'s config (or ``config``) with random fp32
    weights written by transformers, seeded, so every engine loads the same weights."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dst = work / "random-weights"
    dst.mkdir(parents=True, exist_ok=True)
    if folder is not None:
        for name in ("config.json", "generation_config.json"):
            if (folder / name).is_file():
                shutil.copy(folder / name, dst / name)
    else:
        (dst / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(dst)), dtype=torch.float32)
    model.save_pretrained(str(dst))
    return dst


def median_ms(fn, reps: int, warmup: int = 1, cuda: bool = True) -> float:
    """Median milliseconds of ``reps`` eager calls of ``fn`` after ``warmup`` more: CUDA events around
    each call (synchronized before and after) with ``cuda``, else the wall clock."""
    import time

    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_commit() -> str | None:
    """``$KVSERVE_COMMIT`` when set (the device machine's copy of the work tree has no ``.git``, or
    a stale one: JSONs of 2026-11-29 recorded cf00c98 for later trees), else ``git rev-parse``."""
    return os.environ.get("KVSERVE_COMMIT") or _git("rev-parse", "--short", "HEAD")


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def run_info(benchmark: str, argv: list[str] | None = None, smoke: bool = False) -> dict[str, Any]:
    """The record every benchmark JSON starts with (key ``run``)."""
    import torch

    argv = sys.argv[1:] if argv is None else argv
    dirty = _git("status", "--porcelain", "--", "kvserve")
    return {
        "benchmark": benchmark,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python3", f"benchmarks/{benchmark}.py", *argv]),
        "smoke": smoke,
        "git_commit": git_commit(),
        "git_dirty": None if dirty is None else bool(dirty),  # uncommitted changes under kvserve/
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda": torch.version.cuda,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
    }


def has_tokenizer(folder: Path) -> bool:
    """Whether a model folder carries its own tokenizer (else the benchmark serves token ids)."""
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


def write_json(path: str | os.PathLike, doc: dict[str, Any]) -> None:
    """Write ``doc`` atomically (a run cut off by ``timeout`` leaves the last complete file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def default_out(name: str) -> Path:
    """``benchmarks/results/<name>_<YYYYmmdd-HHMMSS>.json``."""
    return RESULTS / f"{name}_{_dt.datetime.now():%Y%m%d-%H%M%S}.json"


def print_summary(text: str) -> None:
    """The script's one-line headline; ``gpu.sh`` prints the last ``summary:`` line of each log."""
    print(f"summary: {text}", flush=True)
