"""Per-device launch tables of the grouped MoE GEMMs, as vLLM keeps its fused-MoE config files: one
JSON file per (experts E, expert width N, device, weight dtype), named as vLLM names them
(``E=256,N=512,device_name=NVIDIA_H200.json``, ``,dtype=fp8_w8a8`` for FP8 experts; any H200 reads
``NVIDIA_H200``), mapping token counts M to a launch (``BLOCK_SIZE_M`` = the row block of
``layers/moe.moe_align``, ``BLOCK_SIZE_N``, ``BLOCK_SIZE_K``, ``num_warps``, ``num_stages``; vLLM's
``GROUP_SIZE_M`` / ``SPLIT_K`` are read and ignored: the kernel has no grouped launch order). A batch of
M tokens takes the entry with the nearest key, as vLLM's ``try_get_optimal_moe_config``. Files are
searched in ``$VLLM_TUNED_CONFIG_FOLDER`` first (vLLM's variable), then in ``configs/moe/`` beside
this module; ``benchmarks/moe_bench.py --sweep --write-config DIR`` writes them from its timings.
No table: the kernels' own defaults (``triton_moe.default_tiles``), with vLLM's warning."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvserve.logger import init_logger

if TYPE_CHECKING:
    from kvserve.kernels.triton_moe import MoETiles

logger = init_logger(__name__)

PACKAGE_FOLDER = Path(__file__).resolve().parent / "configs" / "moe"
FP8_W8A8 = "fp8_w8a8"
_REQUIRED = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages")
_IGNORED = ("GROUP_SIZE_M", "SPLIT_K")


@dataclass(frozen=True)
class MoELaunch:
    """One table entry: the row block of ``moe_align`` and the GEMMs' tiles (both GEMMs take it)."""

    block_m: int
    tiles: MoETiles

    def to_json(self) -> dict[str, int]:
        t = self.tiles
        return {"BLOCK_SIZE_M": self.block_m, "BLOCK_SIZE_N": t.block_n, "BLOCK_SIZE_K": t.block_k,
                "GROUP_SIZE_M": 1, "num_warps": t.num_warps, "num_stages": t.num_stages}


def config_dtype(dtype: torch.dtype, fp8_w8a8: bool = False) -> str | None:
    """vLLM's dtype selector of the file name: ``fp8_w8a8`` for FP8 experts, ``float32`` for float32
    experts, none for bf16 / fp16."""
    if fp8_w8a8:
        return FP8_W8A8
    return "float32" if dtype == torch.float32 else None


def device_file_name(device_name: str) -> str:
    """The device part of a file name: spaces to underscores; any H200 is ``NVIDIA_H200`` (vLLM's rule)."""
    name = device_name.replace(" ", "_")
    return "NVIDIA_H200" if "H200" in name.split("_") else name


def config_file_name(num_experts: int, n: int, device_name: str, dtype: str | None = None) -> str:
    """vLLM's ``get_config_file_name`` (no block-quantization selector: kvserve's FP8 experts are per tensor)."""
    selector = f",dtype={dtype}" if dtype else ""
    return f"E={num_experts},N={n},device_name={device_file_name(device_name)}{selector}.json"


def _positive_pow2(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 and value & (value - 1) == 0


def parse_table(doc: Any, where: str) -> dict[int, MoELaunch]:
    """A table file's JSON as {M: launch}; a bad entry raises naming the file, the key and what is accepted."""
    from kvserve.kernels.triton_moe import MoETiles

    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object mapping token counts to launches, got {type(doc).__name__}")
    table: dict[int, MoELaunch] = {}
    for key, entry in doc.items():
        if key == "triton_version":  # (vLLM's tuner writes it; not a token count)
            continue
        if not (isinstance(key, str) and key.isdigit() and int(key) > 0):
            raise ValueError(f"{where}: key {key!r} is not a positive token count")
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: entry {key} is {type(entry).__name__}, expected an object")
        unknown = sorted(set(entry) - set(_REQUIRED) - set(_IGNORED))
        missing = [f for f in _REQUIRED if f not in entry]
        if unknown or missing:
            raise ValueError(f"{where}: entry {key}: unknown fields {unknown}, missing {missing}; "
                             f"accepted: {list(_REQUIRED)} (and {list(_IGNORED)}, ignored)")
        stages = entry["num_stages"]
        if (not all(_positive_pow2(entry[f]) for f in _REQUIRED[:4]) or min(entry[f] for f in _REQUIRED[:3]) < 16
                or not isinstance(stages, int) or isinstance(stages, bool) or stages < 1):
            raise ValueError(f"{where}: entry {key}: {[(f, entry[f]) for f in _REQUIRED]}: block sizes and warps "
                             "powers of two, block sizes at least 16 (tl.dot), stages a positive integer")
        table[int(key)] = MoELaunch(entry["BLOCK_SIZE_M"], MoETiles(
            entry["BLOCK_SIZE_N"], entry["BLOCK_SIZE_K"], entry["num_warps"], entry["num_stages"]))
    if not table:
        raise ValueError(f"{where}: no token counts")
    return dict(sorted(table.items()))


def search_paths(file_name: str) -> list[Path]:
    """Where a table is looked for, first found wins: ``$VLLM_TUNED_CONFIG_FOLDER``, then the package's."""
    user = os.environ.get("VLLM_TUNED_CONFIG_FOLDER")
    return ([Path(user) / file_name] if user else []) + [PACKAGE_FOLDER / file_name]


@functools.lru_cache(maxsize=None)
def load_table(num_experts: int, n: int, device_name: str, dtype: str | None) -> dict[int, MoELaunch] | None:
    """The table for this shape and device, or None (vLLM's warning, once per shape)."""
    paths = search_paths(config_file_name(num_experts, n, device_name, dtype))
    for path in paths:
        if path.exists():
            logger.info("Using configuration from %s for MoE layer.", path)
            return parse_table(json.loads(path.read_text()), str(path))
    logger.warning("Using default MoE config. Performance might be sub-optimal! Config file not found at %s",
                   ", ".join(map(str, paths)))
    return None


@functools.lru_cache(maxsize=4096)
def _nearest(num_experts: int, n: int, device_name: str, dtype: str | None, tokens: int) -> MoELaunch | None:
    table = load_table(num_experts, n, device_name, dtype)
    if table is None:
        return None
    return table[min(table, key=lambda m: abs(m - tokens))]  # (keys ascending: a tie takes the smaller)


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def tuned_launch(num_experts: int, n: int, tokens: int, device: torch.device, dtype: str | None = None) -> MoELaunch | None:
    """The table's launch for a batch of ``tokens`` tokens on ``device`` (CUDA only), else None."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _nearest(num_experts, n, _device_name(index), dtype, tokens)
