"""Engine flags on the command line, shared by ``kvserve generate / chat / parity / serve / bench
throughput`` (vLLM keeps them beside ``EngineArgs`` as ``add_cli_args`` / ``from_cli_args``).
Torch-free, so building the ``kvserve`` parser does not import torch."""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.choices import (
    ATTENTION_BACKEND_CHOICES,
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    LOAD_FORMAT_CHOICES,
    MAMBA_CACHE_MODE_CHOICES,
    QUANTIZATION_CHOICES,
    attention_backend_name,
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags (vLLM's names and defaults) as an ``engine`` argument group of ``p``."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local HF checkpoint folder (default: SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_CHOICES,
                   help="weight quantization method (default: from the checkpoint); kvserve runs "
                        "modelopt, modelopt_fp4, modelopt_mixed")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes (CPU default: VLLM_CPU_KVCACHE_SPACE GiB or 4 GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="auto")
    g.add_argument("--attention-backend", default="auto", type=attention_backend_name,
                   choices=ATTENTION_BACKEND_CHOICES,
                   help="auto: vLLM's choice on CUDA (FLASH_ATTN on Hopper, else TRITON_ATTN for fp8 pages), "
                        "reference on CPU; triton: kvserve's dequantizing read of fp8 pages (docs/GPU.md)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode batches")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="largest decode batch captured as a CUDA graph (default min(2 x max-num-seqs, 512))")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMAT_CHOICES,
                   help="dummy: random weights (for benchmarks), as vLLM's --load-format dummy")
    g.add_argument("--skip-tokenizer-init", action="store_true", help="no tokenizer: token-id prompts only")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the current one runs (default: on for CUDA)")
    g.add_argument("--mamba-cache-mode", default="none", choices=MAMBA_CACHE_MODE_CHOICES,
                   help="hybrid models: 'align' caches recurrent states at step ends on multiples of "
                        "--mamba-block-size (the default with prefix caching; 'all' falls back to it)")
    g.add_argument("--mamba-block-size", type=int, default=None,
                   help="hybrid prefix caching: tokens between state snapshots (a multiple of --block-size)")


def _engine_arg_names() -> tuple[str, ...]:
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return tuple(a.dest for a in parser._actions)


#: the destinations of the engine flags: EngineArgs' fields, in order (a test checks the two agree)
ENGINE_ARG_NAMES: tuple[str, ...] = _engine_arg_names()


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine flags as ``EngineArgs`` / ``LLM`` keyword arguments."""
    return {k: getattr(args, k) for k in ENGINE_ARG_NAMES}
