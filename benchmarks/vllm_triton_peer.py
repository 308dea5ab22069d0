"""vLLM's own Triton attention (the TRITON_ATTN backend's ``unified_attention``) as a peer of
kvserve's kernel, run from vLLM's source files on the very pages kvserve reads.

vLLM itself does not travel (its wheel is 336 MB and pulls its own torch): the two source files of
a release do, ``vllm/v1/attention/ops/triton_unified_attention.py`` and ``triton_attention_helpers.py``
(checked with vLLM 0.33.0's wheel), in a folder given with ``kernel_bench --vllm-triton-src DIR``.
``load`` runs them with stand-ins for the few vllm modules they import (envs, logger, platforms,
triton_utils, kv_cache_interface); nothing of vLLM is shipped with kvserve.

The call is the backend's (vLLM 0.33 ``triton_attn.py``): K and V are views of one cache, fp8 pages
are read with the query quantized to e4m3 with ``q_scale`` (TRITON_ATTN on CUDA:
``supports_quant_query_input``) and per-tensor descales, and the 2D / 3D (split-KV) choice follows
its metadata builder: 3D when the batch's query blocks are at most ``128 // num_kv_heads``
(``MIN_LAUNCH_GRID_SIZE_2D``), in 16 segments (``NUM_PAR_SOFTMAX_SEGMENTS``), with scratch for that
many sequences. (With CUDA graphs vLLM snaps that threshold to the nearest capture size; the peer
keeps the plain one.)
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import sys
import types
from pathlib import Path

import torch

SOURCE_FILES = ("triton_unified_attention.py", "triton_attention_helpers.py")
MIN_LAUNCH_GRID_SIZE_2D = 128  # vLLM 0.33 triton_attn.py
NUM_PAR_SOFTMAX_SEGMENTS = 16
TILE_FP8 = 32  # its key tile for fp8 queries, 2D and 3D (``_get_tile_size``)
_MODULE = "_kvserve_peer_vllm_unified_attention"


def available(src: str | None) -> str | None:
    """None when the source is there, else why not."""
    if not src:
        return "no source (--vllm-triton-src DIR with vLLM's " + " and ".join(SOURCE_FILES) + ")"
    missing = [f for f in SOURCE_FILES if not (Path(src) / f).is_file()]
    if missing:
        return f"{src} lacks {', '.join(missing)}"
    return None  # (a CPU runs it under the Triton interpreter: kernel_bench --smoke)


class KVQuantMode(enum.IntEnum):
    """vLLM 0.33's ``vllm.v1.kv_cache_interface.KVQuantMode`` (the values its kernel dispatches on)."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


class _Logger(logging.LoggerAdapter):
    """vLLM's logger: the ``*_once`` methods log every time here."""

    def __getattr__(self, name: str):
        if name.endswith("_once"):
            return getattr(self, name[: -len("_once")])
        raise AttributeError(name)


class _Platform:
    """The ``current_platform`` methods the kernel file calls, for a CUDA device."""

    @staticmethod
    def fp8_dtype() -> torch.dtype:
        return torch.float8_e4m3fn

    @staticmethod
    def is_device_capability_family(major: int) -> bool:
        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] * 10 == major


def _stubs() -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    def module(name: str, **attrs) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []  # a package, so submodules resolve
        return m

    return {
        "vllm": module("vllm"),
        "vllm.envs": module("vllm.envs", VLLM_BATCH_INVARIANT=False),
        "vllm.logger": module("vllm.logger", init_logger=lambda n: _Logger(logging.getLogger(n), {})),
        "vllm.platforms": module("vllm.platforms", current_platform=_Platform()),
        "vllm.triton_utils": module("vllm.triton_utils", tl=tl, triton=triton),
        "vllm.v1": module("vllm.v1"),
        "vllm.v1.attention": module("vllm.v1.attention"),
        "vllm.v1.attention.ops": module("vllm.v1.attention.ops"),
        "vllm.v1.kv_cache_interface": module("vllm.v1.kv_cache_interface", KVQuantMode=KVQuantMode),
    }


def load(src: str | Path) -> types.ModuleType:
    """vLLM's ``triton_unified_attention`` module from ``src``, its vllm imports served by stand-ins
    (only while it loads; a real vllm install is left alone)."""
    src = Path(src)
    stubs = _stubs()
    saved = {name: sys.modules.get(name) for name in stubs}
    helpers_name = "vllm.v1.attention.ops.triton_attention_helpers"
    saved[helpers_name] = sys.modules.get(helpers_name)
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location(helpers_name, src / SOURCE_FILES[1])
        helpers = importlib.util.module_from_spec(spec)
        sys.modules[helpers_name] = helpers
        spec.loader.exec_module(helpers)
        spec = importlib.util.spec_from_file_location(_MODULE, src / SOURCE_FILES[0])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_MODULE] = mod  # Triton resolves the kernels' globals through the module
        spec.loader.exec_module(mod)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return mod


class VllmTritonAttention:
    """One loaded source and the backend's split-KV scratch; ``run`` per batch."""

    def __init__(self, src: str | Path, num_q_heads: int, num_kv_heads: int, head: int, max_num_seqs: int,
                 device: torch.device) -> None:
        self.mod = load(src)
        self.seq_threshold_3d = MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads
        rows = min(self.seq_threshold_3d, max_num_seqs)  # decode: one query token a sequence
        pad = 1 << (head - 1).bit_length()
        f32 = dict(dtype=torch.float32, device=device)
        self.segm_output = torch.empty(rows, num_q_heads, NUM_PAR_SOFTMAX_SEGMENTS, pad, **f32)
        self.segm_max = torch.empty(rows, num_q_heads, NUM_PAR_SOFTMAX_SEGMENTS, **f32)
        self.segm_expsum = torch.empty(rows, num_q_heads, NUM_PAR_SOFTMAX_SEGMENTS, **f32)

    def uses_3d(self, num_seqs: int) -> bool:
        """Whether a decode batch of ``num_seqs`` runs vLLM's 3D (split-KV) launch."""
        return num_seqs <= min(self.seq_threshold_3d, self.segm_max.shape[0])

    def run(self, q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
            seq_lens: torch.Tensor, max_query_len: int, max_seq_len: int, scale: float, out: torch.Tensor,
            quant=None) -> torch.Tensor:
        """``pool``: kvserve's cache [NB, 2, BS, Hk, D], bf16 or uint8 fp8 codes (read with ``quant``,
        a ``reference.CacheQuant``: the query quantized with its q_scale, as the backend does)."""
        from kvserve.kernels.reference import quantize_query_fp8

        cache = pool.view(torch.float8_e4m3fn) if pool.dtype == torch.uint8 else pool
        k, v = cache[:, 0], cache[:, 1]
        num_seqs = seq_lens.shape[0]
        shape = (num_seqs, pool.shape[3])  # the backend expands the layer's scales per (sequence, KV head)
        if quant is not None:
            q = quantize_query_fp8(q, quant.inv_q_scale_t)
            kw = dict(q_descale=quant.q_scale_t.view(1), k_descale=quant.k_scale_t.view(1, 1).expand(shape),
                      v_descale=quant.v_scale_t.view(1, 1).expand(shape), kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
        else:
            one = torch.ones(1, 1, dtype=torch.float32, device=q.device).expand(shape)
            kw = dict(q_descale=None, k_descale=one, v_descale=one, kv_quant_mode=KVQuantMode.NONE)
        self.mod.unified_attention(
            q=q, k=k, v=v, out=out, cu_seqlens_q=query_start_loc, max_seqlen_q=max_query_len, seqused_k=seq_lens,
            max_seqlen_k=max_seq_len, softmax_scale=scale, causal=True, window_size=(-1, -1),
            block_table=block_tables, softcap=0, seq_threshold_3D=self.seq_threshold_3d,
            num_par_softmax_segments=NUM_PAR_SOFTMAX_SEGMENTS, softmax_segm_output=self.segm_output,
            softmax_segm_max=self.segm_max, softmax_segm_expsum=self.segm_expsum, **kw)
        return out
