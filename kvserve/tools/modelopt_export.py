"""Write NVIDIA ModelOpt-format checkpoints from a bf16/fp32 HF folder, for tests and benchmarks.

    python -m kvserve.tools.modelopt_export SRC DST --algo NVFP4|W4A16_NVFP4|FP8|MIXED_PRECISION \\
        [--kv-cache-quant-algo FP8|none] [--calibration-tokens N] [--seed S] [--config-only]

``--config-only`` writes the export's configs and no weights (SRC needs only its config.json): the
quantization layout of a model too large to export here, for ``--load-format dummy`` runs (the
benchmarks' 27B shape), where the packed weights are random codes and no scale is read.

Not ModelOpt: no AWQ/MSE, max calibration on random token ids, but the same files, tensor names,
scales and config fields as ModelOpt's unified HF export (Model-Optimizer
``modelopt/torch/export/unified_export_hf.py``, ``quant_utils.py``, ``convert_hf_config.py``,
``modelopt_recipes/``), so a loader that reads this reads theirs:

* Which layers: ModelOpt's quantizer-name rules, last match wins, over ``<m>.weight_quantizer`` /
  ``<m>.input_quantizer`` (fused experts: ``<m>.gate_up_proj_weight_quantizer`` ...). The single
  algos are ``*weight_quantizer`` (+ ``*input_quantizer`` for NVFP4 / FP8) then
  ``default_disabled_quantizers`` (conv1d, in_proj_a/b, lm_head, mlp.gate., shared_expert_gate.,
  router, mtp, visual/vision, embeddings); MIXED_PRECISION is the Qwen3.5/3.6 recipe
  ``w4a16_nvfp4-fp8_attn-kv_fp8_cast``: W4A16_NVFP4 on ``*mlp*{gate,up,down}_proj*`` (dense MLP,
  shared expert, routed experts) and lm_head, FP8 on ``*self_attn*`` and
  ``linear_attn.in_proj_qkv*`` / ``in_proj_z`` / ``out_proj``. On Llama / Qwen3 dense models the
  same rules give MLP + lm_head W4A16_NVFP4 and attention FP8.
* Tensors per quantized Linear ``<m>``: NVFP4 / W4A16_NVFP4 ``<m>.weight`` uint8 [out, in/2],
  ``<m>.weight_scale`` e4m3 [out, in/16], ``<m>.weight_scale_2`` fp32 scalar, NVFP4 also
  ``<m>.input_scale`` = x_amax / (6 * 448); FP8 ``<m>.weight`` e4m3, ``<m>.weight_scale`` =
  w_amax / 448 and ``<m>.input_scale`` = x_amax / 448. No KV scale tensors (the ``fp8_cast`` KV
  preset: constant amax, scale 1.0 implied).
* Fusion (``requantize_resmooth_fused_llm_layers``): quantized Linears that read the same input
  tensor (q/k/v, gate/up, Qwen3.5 GDN in_proj_qkv + in_proj_z) share ``weight_scale_2`` and
  ``input_scale`` (the max over the group), except FP8 groups, which ModelOpt leaves unfused
  (each keeps its own ``weight_scale``). Routed experts of transformers' fused ``*Experts`` modules
  (one weight quantizer per expert over gate_up, one input quantizer per projection for all
  experts) give each expert's gate_proj / up_proj one weight scale and every expert the same
  ``input_scale``; they are written per expert (``<m>.experts.<e>.{gate,up,down}_proj``) and named
  ``<m>.experts`` in ``quantized_layers`` / ``exclude_modules``.
* ``hf_quant_config.json`` (``get_quant_config`` + ``process_layer_quant_config``: one format ->
  ``quant_algo`` / ``group_size`` / ``exclude_modules`` as prefix wildcards; more -> MIXED_PRECISION
  with ``quantized_layers``) and ``config.json["quantization_config"]``
  (``convert_hf_quant_config_format``: ``config_groups``, ``ignore``, ``kv_cache_scheme``,
  ``quant_method: "modelopt"``). Checkpoint tensors with "mtp" in the name are copied as they are
  and their prefixes excluded (``hf_ptq``'s ``load_mtp_weights`` + ``_add_mtp_exclusions``).

Activation amax: ``AutoModelForCausalLM`` in float32 on CPU over ``calibration_tokens`` random
token ids, forward pre-hooks on every ``nn.Linear`` (and on the experts' ``F.linear`` calls)
recording max |x|. The same pass finds which Linears share an input. Weights are read, quantized
and written one tensor at a time (shards of at most ``shard_bytes``).
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import nn

from kvserve.logger import init_logger
from kvserve.quant.nvfp4 import (
    E2M1_MAX,
    E4M3_MAX,
    NVFP4_GROUP_SIZE,
    quantize_fp8_per_tensor,
    quantize_nvfp4,
    scale_from_amax,
)

logger = init_logger(__name__)

ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8", "MIXED_PRECISION")
KV_ALGOS = (None, "FP8")
MODELOPT_VERSION = "0.45.0"  # the Model Optimizer release of nvidia/Qwen3.6-27B-NVFP4
NVFP4_BOUND = E2M1_MAX * E4M3_MAX  # 2688

# modelopt_recipes/configs/ptq/units/default_disabled_quantizers.yaml (nn.Embedding: by class)
_DEFAULT_DISABLED = (
    "*block_sparse_moe.gate*", "*linear_attn.conv1d*", "*linear_attn.in_proj_a*", "*linear_attn.in_proj_b*",
    "*lm_head*", "*mixer.conv1d*", "*mlp.gate.*", "*mlp.shared_expert_gate.*", "*output_layer*", "*proj_out.*",
    "*router*", "mtp.*", "output.*", "*embed_vision*", "*vision_tower*", "*visual*", "*vision_model*",
    "*multi_modal_projector*",
)
_DISABLE = [(p, None) for p in _DEFAULT_DISABLED]
# (quantizer-name pattern, "nvfp4" | "fp8" | None), after ``base_disable_all``; the last match wins.
_RULES: dict[str, list[tuple[str, str | None]]] = {
    "NVFP4": [("*weight_quantizer", "nvfp4"), ("*input_quantizer", "nvfp4"), *_DISABLE],
    "W4A16_NVFP4": [("*weight_quantizer", "nvfp4"), *_DISABLE],
    "FP8": [("*weight_quantizer", "fp8"), ("*input_quantizer", "fp8"), *_DISABLE],
    # modelopt_recipes/huggingface/qwen3_5/ptq/w4a16_nvfp4-fp8_attn-kv_fp8_cast.quant_cfg.yaml
    "MIXED_PRECISION": [
        ("*mlp*gate_proj*weight_quantizer*", "nvfp4"),
        ("*mlp*up_proj*weight_quantizer*", "nvfp4"),
        ("*mlp*down_proj*weight_quantizer*", "nvfp4"),
        ("*self_attn*weight_quantizer", "fp8"),
        ("*self_attn*input_quantizer", "fp8"),
        *[(f"*linear_attn.{p}*{q}_quantizer", "fp8") for p in ("in_proj_qkv", "in_proj_z", "out_proj") for q in ("weight", "input")],
        *_DISABLE,
        ("*linear_attn.in_proj_a*", None),
        ("*linear_attn.in_proj_b*", None),
        ("*visual*", None),
        ("*vision_tower*", None),
        ("*mtp*", None),
        ("*lm_head*weight_quantizer", "nvfp4"),
    ],
}
_EXPERT_KEY = re.compile(r"^(?P<experts>.+)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_LIST_QUANTIZER = re.compile(r"((?:weight|input)_quantizers?)\.\d+")


# ------------------------------------------------------------------------------- quantizer rules


def _rule_cfg(algo: str, quantizer: str) -> str | None:
    normal = _LIST_QUANTIZER.sub(lambda m: m.group(1).removesuffix("s"), quantizer)
    cfg = None
    for pattern, value in _RULES[algo]:
        if fnmatch.fnmatchcase(quantizer, pattern) or fnmatch.fnmatchcase(normal, pattern):
            cfg = value
    return cfg


def _format(weight_cfg: str | None, input_cfg: str | None, where: str) -> str | None:
    if weight_cfg is None:
        return None
    fmt = {("nvfp4", "nvfp4"): "NVFP4", ("nvfp4", None): "W4A16_NVFP4", ("fp8", "fp8"): "FP8"}.get((weight_cfg, input_cfg))
    if fmt is None:
        raise NotImplementedError(f"{where}: weight {weight_cfg} with input {input_cfg} is not a supported format")
    return fmt


def module_format(algo: str, name: str, kind: str) -> str | None:
    """The ModelOpt format of module ``name`` (``kind`` linear / experts / embedding / conv / router)
    under ``algo``'s rules: "NVFP4", "W4A16_NVFP4", "FP8" or None (left unquantized)."""
    if kind == "linear":
        return _format(_rule_cfg(algo, f"{name}.weight_quantizer"), _rule_cfg(algo, f"{name}.input_quantizer"), name)
    if kind == "experts":
        fmts = {
            _format(_rule_cfg(algo, f"{name}.{p}_weight_quantizers.0"), _rule_cfg(algo, f"{name}.{p}_input_quantizer"), name)
            for p in ("gate_up_proj", "down_proj")
        }
        if len(fmts) > 1:
            raise NotImplementedError(f"{name}: gate_up_proj and down_proj would get different formats {sorted(map(str, fmts))}")
        return fmts.pop()
    return None  # embeddings (disabled by class), conv1d, routers: never quantized here


# ---------------------------------------------------------------------------- config summaries


def summarize_exclude_modules(unquantized: Iterable[str], quantized: Iterable[str]) -> list[str]:
    """ModelOpt's ``_prefix_wildcard_summarize_exclude_modules``: for each unquantized module the
    shortest dot-boundary wildcard ``prefix*`` (or the pair ``prefix`` + ``prefix.*``, written as
    ``prefix.*``) that matches no quantized module, else the exact name; sorted."""
    negative: set[str] = set()
    for q in quantized:
        negative.add(q)
        negative.update(q[:i] + "*" for i in range(len(q) + 1))
    summary: set[str] = set()
    for name in unquantized:
        options = []
        for i, ch in enumerate(name):
            if ch == ".":
                options += [[name[:i] + "*"], [name[:i], name[:i] + ".*"]]
        options.append([name])
        chosen: list[str] = []
        for option in options:
            if any(w in negative for w in option):
                continue
            if all(w in summary for w in option):
                chosen = []
                break
            chosen = option
            break
        if len(chosen) == 2:
            chosen = [chosen[1]]  # [prefix, prefix.*] -> prefix.*
        summary.update(chosen)
    return sorted(summary)


def _group_config(algo: str, group_size: int | None) -> dict:
    """``convert_hf_config._quant_algo_to_group_config`` for the formats written here."""
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    if algo == "FP8":
        return {"input_activations": dict(fp8), "weights": dict(fp8)}
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size or NVFP4_GROUP_SIZE}
    if algo == "NVFP4":
        return {"input_activations": dict(fp4), "weights": dict(fp4)}
    if algo == "W4A16_NVFP4":
        return {"weights": dict(fp4)}
    raise ValueError(algo)


def hf_quant_config(
    formats: dict[str, str | None], kv_cache_quant_algo: str | None, extra_exclude: Sequence[str] = (),
    group_size: int = NVFP4_GROUP_SIZE,
) -> dict:
    """``hf_quant_config.json`` for modules -> format (None: has a quantizer, left unquantized), in
    module order, like ``get_quant_config`` + ``process_layer_quant_config``."""
    def layer_cfg(fmt: str) -> dict:
        return {"quant_algo": fmt} if fmt == "FP8" else {"quant_algo": fmt, "group_size": group_size}

    quantized = {m: layer_cfg(f) for m, f in formats.items() if f is not None}
    distinct = {json.dumps(c, sort_keys=True) for c in quantized.values()}
    q: dict = {"quant_algo": None, "kv_cache_quant_algo": kv_cache_quant_algo}
    if len(distinct) > 1:
        q["quant_algo"] = "MIXED_PRECISION"
        q["quantized_layers"] = quantized
        if extra_exclude:
            q["exclude_modules"] = list(extra_exclude)
    elif distinct:
        q.update(json.loads(distinct.pop()))
        unquantized = [m for m, f in formats.items() if f is None]
        q["exclude_modules"] = summarize_exclude_modules(unquantized, quantized) + list(extra_exclude)
    return {"producer": {"name": "modelopt", "version": MODELOPT_VERSION}, "quantization": q}


def quantization_config(hf: dict) -> dict:
    """``config.json["quantization_config"]`` from an ``hf_quant_config.json`` dict
    (``convert_hf_quant_config_format``)."""
    q = hf["quantization"]
    algo = q.get("quant_algo")
    out: dict = {}
    if algo in ("FP8", "NVFP4", "W4A16_NVFP4"):
        out["config_groups"] = {"group_0": {**_group_config(algo, q.get("group_size")), "targets": ["Linear"]}}
    elif algo == "MIXED_PRECISION":
        by_cfg: dict[tuple, list[str]] = {}
        for layer, cfg in q.get("quantized_layers", {}).items():
            by_cfg.setdefault(tuple(sorted(cfg.items())), []).append(layer)
        out["config_groups"] = {
            f"group_{i}": {**_group_config(dict(key)["quant_algo"], dict(key).get("group_size")), "targets": sorted(layers)}
            for i, (key, layers) in enumerate(by_cfg.items())
        }
        out["quantized_layers"] = q.get("quantized_layers", {})
    out["ignore"] = list(q.get("exclude_modules") or [])
    if algo:
        out["quant_algo"] = algo
    kv = q.get("kv_cache_quant_algo")
    if kv:
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"} if kv == "FP8" else kv
    if hf.get("producer"):
        out["producer"] = hf["producer"]
    out["quant_method"] = "modelopt"
    return out


# ---------------------------------------------------------------------------------- calibration


@dataclass
class Calibration:
    """What one calibration pass learns: module kinds in module order, activation amax per Linear
    (and per experts projection, ``<experts>.gate_up_proj`` / ``.down_proj``), and which Linears read
    the same input tensor."""

    kinds: dict[str, str] = field(default_factory=dict)
    input_amax: dict[str, float] = field(default_factory=dict)
    shared_input: list[set[str]] = field(default_factory=list)


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _module_kinds(model: nn.Module) -> dict[str, str]:
    kinds: dict[str, str] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            kinds[name] = "linear"
        elif isinstance(mod, nn.Embedding):
            kinds[name] = "embedding"
        elif isinstance(mod, _CONVS):
            kinds[name] = "conv"
        elif _is_fused_experts(mod):
            kinds[name] = "experts"
        if hasattr(mod, "experts"):  # MoE block: its non-Linear router has no quantizer but is excluded
            for attr in ("gate", "router", "shared_expert_gate"):
                sub = getattr(mod, attr, None)
                if (isinstance(sub, nn.Module) and not isinstance(sub, nn.Linear)
                        and isinstance(getattr(sub, "weight", None), torch.Tensor)):
                    kinds[f"{name}.{attr}" if name else attr] = "router"
    return kinds


def _is_fused_experts(mod: nn.Module) -> bool:
    gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3


def calibration_ids(vocab_size: int, calibration_tokens: int, seed: int, seq_len: int = 256) -> list[torch.Tensor]:
    """The calibration batches: ``calibration_tokens`` uniform random ids in sequences [1, <= seq_len]."""
    gen = torch.Generator().manual_seed(seed)
    out, left = [], calibration_tokens
    while left > 0:
        n = min(left, seq_len)
        out.append(torch.randint(0, vocab_size, (1, n), generator=gen))
        left -= n
    return out


def calibrate(src: Path, calibration_tokens: int, seed: int, seq_len: int = 256) -> Calibration:
    """Run ``src`` in float32 transformers on random token ids and record :class:`Calibration`."""
    from transformers import AutoModelForCausalLM

    if calibration_tokens < 1:
        raise ValueError(f"calibration_tokens must be >= 1, got {calibration_tokens}")
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, experts_implementation="eager")
    except (TypeError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.eval()
    cal = Calibration(kinds=_module_kinds(model))
    amax = cal.input_amax
    seen: dict[int, tuple[torch.Tensor, list[str]]] = {}

    def record(key: str, x: torch.Tensor) -> None:
        v = float(x.detach().abs().amax()) if x.numel() else 0.0
        amax[key] = max(amax.get(key, 0.0), v)

    def linear_hook(name):
        def hook(_mod, args):
            if args and isinstance(args[0], torch.Tensor):
                record(name, args[0])
                seen.setdefault(id(args[0]), (args[0], []))[1].append(name)
        return hook

    orig_linear = torch.nn.functional.linear

    def experts_hooks(name, mod):
        ptrs = {
            mod.gate_up_proj.untyped_storage().data_ptr(): f"{name}.gate_up_proj",
            mod.down_proj.untyped_storage().data_ptr(): f"{name}.down_proj",
        }

        def linear(input, weight, bias=None):
            key = ptrs.get(weight.untyped_storage().data_ptr())
            if key is not None:
                record(key, input)
            return orig_linear(input, weight, bias)

        def pre(_mod, _args):
            torch.nn.functional.linear = linear

        def post(_mod, _args, _out):
            torch.nn.functional.linear = orig_linear

        return pre, post

    handles = []
    for name, mod in model.named_modules():
        kind = cal.kinds.get(name)
        if kind == "linear":
            handles.append(mod.register_forward_pre_hook(linear_hook(name)))
        elif kind == "experts":
            pre, post = experts_hooks(name, mod)
            handles.append(mod.register_forward_pre_hook(pre))
            handles.append(mod.register_forward_hook(post))
    groups: dict[str, str] = {}

    def find(a: str) -> str:
        while groups.setdefault(a, a) != a:
            a = groups[a]
        return a

    try:
        with torch.no_grad():
            for ids in calibration_ids(model.get_input_embeddings().num_embeddings, calibration_tokens, seed, seq_len):
                model(input_ids=ids, use_cache=False)
                for _x, names in seen.values():
                    for other in names[1:]:
                        groups[find(other)] = find(names[0])
                    find(names[0])
                seen.clear()
    finally:
        torch.nn.functional.linear = orig_linear
        for h in handles:
            h.remove()
    members: dict[str, set[str]] = {}
    for name in list(groups):
        members.setdefault(find(name), set()).add(name)
    cal.shared_input = [g for g in members.values() if len(g) > 1]
    del model
    gc.collect()
    return cal


# ------------------------------------------------------------------------------------ the export


@dataclass
class _Target:
    """One matrix to quantize: written as ``out`` (+ ``.weight``, ``.weight_scale`` ...)."""

    out: str
    key: str  # checkpoint tensor
    index: tuple[int, slice] | None  # fused 3-D experts: (expert, rows)
    fmt: str
    module: str
    weight_group: str  # targets with the same weight_group share weight_scale_2 / FP8 expert scale
    input_key: str  # calibration key of its input amax
    input_group: str  # targets with the same input_group share input_scale
    shape: tuple[int, ...] = ()


class _Checkpoint:
    """Tensor names -> file of a safetensors folder (single file or index)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.files = sorted(folder.glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                for k in f.keys():
                    self.where[k] = path
                    self.shapes[k] = tuple(f.get_slice(k).get_shape())
        self._open: tuple[Path, object] | None = None

    def _handle(self, key: str):
        from safetensors import safe_open

        path = self.where[key]
        if self._open is None or self._open[0] != path:
            self._open = (path, safe_open(str(path), framework="pt"))
        return self._open[1]

    def get(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def read(self, target: _Target) -> torch.Tensor:
        if target.index is None:
            return self.get(target.key)
        e, rows = target.index  # one expert of a fused 3-D tensor, read alone
        return self._handle(target.key).get_slice(target.key)[e : e + 1, rows][0].contiguous()


def _targets(ckpt: _Checkpoint, cal: Calibration, formats: dict[str, str | None], group_size: int) -> list[_Target]:
    """The matrices to quantize, with their fusion groups; modules without checkpoint tensors (a
    tied lm_head) are set to None in ``formats``."""
    out: list[_Target] = []
    experts_keys: dict[str, list[tuple[int, str, str]]] = {}
    for k in ckpt.shapes:
        if m := _EXPERT_KEY.match(k):
            experts_keys.setdefault(m["experts"], []).append((int(m["e"]), m["proj"], k))
    fused_of: dict[str, str] = {}
    for group in cal.shared_input:
        live = sorted(m for m in group if formats.get(m) is not None)
        fmts = {formats[m] for m in live}
        if len(live) < 2:
            continue
        if len(fmts) > 1:
            raise NotImplementedError(f"modules {live} read the same input but get different formats {sorted(fmts)}")
        if fmts.pop() != "FP8":  # ModelOpt leaves FP8 groups unfused
            for m in live:
                fused_of[m] = live[0]
    for module, fmt in list(formats.items()):
        if fmt is None:
            continue
        if cal.kinds[module] == "linear":
            key = f"{module}.weight"
            if key not in ckpt.shapes:
                logger.info("%s: no %s in the checkpoint (tied?); left unquantized", module, key)
                formats[module] = None
                continue
            grp = fused_of.get(module, module)
            out.append(_Target(module, key, None, fmt, module, grp, module, grp, ckpt.shapes[key]))
            continue
        # fused experts: per-expert tensors on disk (transformers' save format) or 3-D fused ones
        per_expert = sorted(experts_keys.get(module, []))
        fused = f"{module}.gate_up_proj", f"{module}.down_proj"
        items: list[tuple[int, str, str, tuple[int, slice] | None, tuple[int, ...]]] = []
        if per_expert:
            items = [(e, proj, key, None, ckpt.shapes[key]) for e, proj, key in per_expert]
        elif all(k in ckpt.shapes for k in fused):
            n, two_i, hidden = ckpt.shapes[fused[0]]
            inter = two_i // 2
            down = ckpt.shapes[fused[1]][1:]
            for e in range(n):
                items += [
                    (e, "gate_proj", fused[0], (e, slice(0, inter)), (inter, hidden)),
                    (e, "up_proj", fused[0], (e, slice(inter, two_i)), (inter, hidden)),
                    (e, "down_proj", fused[1], (e, slice(None)), down),
                ]
        else:
            raise KeyError(f"{module}: no expert tensors ({module}.<e>.gate_proj.weight or {fused[0]}) in the checkpoint")
        for e, proj, key, index, shape in items:
            part = "down" if proj == "down_proj" else "gate_up"
            inp = f"{module}.{part}_proj"
            out.append(_Target(f"{module}.{e}.{proj}", key, index, fmt, module, f"{module}.{e}.{part}", inp, inp, shape))
    for t in out:
        if len(t.shape) != 2:
            raise ValueError(f"{t.key}: a quantized Linear weight must be 2-D, got shape {t.shape}")
        if t.fmt != "FP8" and t.shape[1] % group_size:
            raise ValueError(
                f"{t.key}: in_features {t.shape[1]} of shape {t.shape} is not a multiple of the NVFP4 group size "
                f"{group_size} (ModelOpt pads; this exporter refuses)"
            )
    return out


def _mtp_prefixes(keys: Iterable[str]) -> list[str]:
    """``hf_ptq`` ``_keys_to_prefixes`` over the tensor names holding "mtp"."""
    prefixes: set[str] = set()
    for key in keys:
        if "mtp" not in key:
            continue
        parts = key.split(".")
        if parts[0] != "model":
            prefixes.add(parts[0])
        for i, part in enumerate(parts):
            if part == "layers" and i + 1 < len(parts) and parts[i + 1].isdigit():
                prefixes.add(".".join(parts[: i + 2]))
                break
    return sorted(prefixes)


class _ShardWriter:
    def __init__(self, dst: Path, shard_bytes: int):
        self.dst, self.shard_bytes = dst, shard_bytes
        self.buf: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[tuple[Path, list[str]]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.buf or any(name in keys for _p, keys in self.shards):
            raise KeyError(f"duplicate output tensor {name}")
        nbytes = t.numel() * t.element_size()
        if self.buf and self.size + nbytes > self.shard_bytes:
            self.flush()
        self.buf[name] = t.contiguous()
        self.size += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.buf:
            return
        path = self.dst / f"model-part-{len(self.shards):05d}.safetensors"
        save_file(self.buf, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.buf)))
        self.buf, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        if len(self.shards) == 1:
            self.shards[0][0].rename(self.dst / "model.safetensors")
            return
        total = len(self.shards)
        weight_map = {}
        for i, (path, keys) in enumerate(self.shards):
            final = self.dst / f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            path.rename(final)
            weight_map.update({k: final.name for k in keys})
        size = sum((self.dst / f).stat().st_size for f in set(weight_map.values()))
        index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _source_config(src: Path, dst: Path, algo: str, kv_cache_quant_algo: str | None) -> dict:
    """``src``'s config.json, after checking the export's arguments."""
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if kv_cache_quant_algo not in KV_ALGOS:
        raise ValueError(f"kv_cache_quant_algo must be one of {KV_ALGOS}, got {kv_cache_quant_algo!r}")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")
    return config


def _write_configs(src: Path, dst: Path, config: dict, hf: dict) -> None:
    """hf_quant_config.json, config.json with its quantization_config, and src's other small files."""
    (dst / "hf_quant_config.json").write_text(json.dumps(hf, indent=4) + "\n")
    config["quantization_config"] = quantization_config(hf)
    (dst / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    skip = {"config.json", "hf_quant_config.json", "model.safetensors.index.json"}
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
            shutil.copy2(f, dst / f.name)


def export_modelopt(
    src: Path,
    dst: Path,
    algo: str,
    *,
    kv_cache_quant_algo: str | None = "FP8",
    calibration_tokens: int = 512,
    seed: int = 0,
    shard_bytes: int = 4 << 30,
) -> Path:
    """Write a ModelOpt-format export of the HF folder ``src`` into ``dst`` (new or empty) and
    return ``dst``. ``algo``: NVFP4 (W4A4), W4A16_NVFP4, FP8 (per-tensor W8A8) or MIXED_PRECISION
    (the Qwen3.5/3.6 recipe). See the module docstring for what is written."""
    src, dst = Path(src), Path(dst)
    config = _source_config(src, dst, algo, kv_cache_quant_algo)
    dst.mkdir(parents=True, exist_ok=True)
    group_size = NVFP4_GROUP_SIZE

    ckpt = _Checkpoint(src)
    cal = calibrate(src, calibration_tokens, seed)
    formats = {m: module_format(algo, m, kind) for m, kind in cal.kinds.items()}
    targets = _targets(ckpt, cal, formats, group_size)
    if not targets:
        raise ValueError(f"{algo}: no Linear of {src} is quantized (do its tensor names match the model's modules?)")
    mtp = _mtp_prefixes(ckpt.shapes)
    by_key: dict[str, list[_Target]] = {}
    for t in targets:
        by_key.setdefault(t.key, []).append(t)

    # shared weight amax (fused groups; gate/up of each expert), and input amax per group
    weight_amax: dict[str, float] = {}
    for t in targets:
        w = ckpt.read(t)
        if not torch.is_floating_point(w) or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{t.key}: expected a bf16/fp16/fp32 weight, got {w.dtype}")
        weight_amax[t.weight_group] = max(weight_amax.get(t.weight_group, 0.0), float(w.abs().amax()))
    input_amax: dict[str, float] = {}
    for t in targets:
        if t.fmt == "W4A16_NVFP4":
            continue
        if cal.input_amax.get(t.input_key, 0.0) <= 0:
            raise ValueError(f"{t.module}: no activation amax ({t.input_key} never ran during calibration)")
        input_amax[t.input_group] = max(input_amax.get(t.input_group, 0.0), cal.input_amax[t.input_key])

    writer = _ShardWriter(dst, shard_bytes)
    for key in ckpt.shapes:
        if key not in by_key:
            writer.add(key, ckpt.get(key))
            continue
        for t in by_key[key]:
            w = ckpt.read(t)
            if t.fmt == "FP8":
                scale = scale_from_amax(weight_amax[t.weight_group], E4M3_MAX)
                q, scale = quantize_fp8_per_tensor(w, scale)
                writer.add(f"{t.out}.weight", q)
                writer.add(f"{t.out}.weight_scale", scale)
                writer.add(f"{t.out}.input_scale", scale_from_amax(input_amax[t.input_group], E4M3_MAX))
            else:
                s2 = scale_from_amax(weight_amax[t.weight_group], NVFP4_BOUND)
                packed, block, s2 = quantize_nvfp4(w, group_size, global_scale=s2)
                writer.add(f"{t.out}.weight", packed)
                writer.add(f"{t.out}.weight_scale", block)
                writer.add(f"{t.out}.weight_scale_2", s2)
                if t.fmt == "NVFP4":
                    writer.add(f"{t.out}.input_scale", scale_from_amax(input_amax[t.input_group], NVFP4_BOUND))
    writer.finish()

    hf = hf_quant_config(formats, kv_cache_quant_algo, [f"{p}*" for p in mtp], group_size)
    _write_configs(src, dst, config, hf)
    logger.info(
        "%s export of %s -> %s: %d quantized matrices, quant_algo %s",
        algo, src, dst, len(targets), hf["quantization"]["quant_algo"],
    )
    return dst


def export_config_only(src: Path, dst: Path, algo: str, *, kv_cache_quant_algo: str | None = "FP8") -> Path:
    """The configs ``export_modelopt`` would write for ``src`` under ``algo``, without weights: the
    module kinds come from transformers' model built on the meta device (no memory, no calibration).
    For ``--load-format dummy``; returns ``dst``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src, dst = Path(src), Path(dst)
    config = _source_config(src, dst, algo, kv_cache_quant_algo)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    formats = {m: module_format(algo, m, kind) for m, kind in _module_kinds(model).items()}
    if not any(formats.values()):
        raise ValueError(f"{algo}: no Linear of {src} would be quantized")
    dst.mkdir(parents=True, exist_ok=True)
    _write_configs(src, dst, config, hf_quant_config(formats, kv_cache_quant_algo))
    return dst


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.tools.modelopt_export", description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="bf16/fp32 HF folder (config.json + *.safetensors)")
    p.add_argument("dst", type=Path, help="output folder (new or empty)")
    p.add_argument("--algo", required=True, choices=ALGOS)
    p.add_argument("--kv-cache-quant-algo", default="FP8", choices=["FP8", "none"])
    p.add_argument("--calibration-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config-only", action="store_true",
                   help="write the configs only, no weights (for --load-format dummy; SRC needs only config.json)")
    args = p.parse_args(argv)
    kv = None if args.kv_cache_quant_algo == "none" else args.kv_cache_quant_algo
    if args.config_only:
        export_config_only(args.src, args.dst, args.algo, kv_cache_quant_algo=kv)
        print(args.dst)
        return 0
    export_modelopt(
        args.src, args.dst, args.algo,
        kv_cache_quant_algo=kv, calibration_tokens=args.calibration_tokens, seed=args.seed,
    )
    print(args.dst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
