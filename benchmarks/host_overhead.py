"""Host time of a decode step with the model taken out (CPU, any machine): an engine on the
triton backend's host path (persistent block table, packed inputs) whose model returns zeros at
once, 256 running requests, greedy, so what is timed is scheduling, input preparation, sampling
launches and output bookkeeping: the part of a step that async scheduling must hide behind the GPU.

    python benchmarks/host_overhead.py [--num-seqs 256] [--out results.json]

Reference points: on the H200's host the same Python runs ~2.5-3.5x slower than on the dev
machine (benchmarks/RESULTS.md, step profiles)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton backend's host path without a GPU
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvserve.config import EngineArgs  # noqa: E402
from kvserve.engine.engine import Engine  # noqa: E402
from kvserve.engine.sampling import RequestOutputKind, SamplingParams  # noqa: E402

VOCAB = 512


class _NoModel:
    """Stands in for the model: zeros of the right shapes, no compute."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], VOCAB)


def measure(num_seqs: int, async_scheduling: bool, steps: int = 100) -> float:
    folder = Path(tempfile.mkdtemp(prefix="kvserve-host-"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }))
    eng = Engine.from_engine_args(EngineArgs(
        model=str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="float32", device="cpu",
        max_num_seqs=num_seqs, max_model_len=4096, kv_cache_memory=1 << 30, attention_backend="triton",
        async_scheduling=async_scheduling))
    eng.runner.model = _NoModel(64)
    for i in range(num_seqs):
        eng.add_request(str(i), {"prompt_token_ids": [(100 + j) % 500 for j in range(300 + i)]},
                        SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True, detokenize=False,
                                       output_kind=RequestOutputKind.FINAL_ONLY))
    while not (len(eng.scheduler.running) == num_seqs and all(r.num_output_tokens > 0 for r in eng.scheduler.running)):
        eng.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = {}
    for mode in (True, False):
        ms = measure(a.num_seqs, mode)
        rows["async" if mode else "serial"] = ms
        print(f"{'async' if mode else 'serial':6s} host-only decode step, {a.num_seqs} sequences: {ms:.3f} ms", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"num_seqs": a.num_seqs, "step_ms_median": rows,
                                           "python": sys.version.split()[0], "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
