"""ModelOpt checkpoints' weight quantization: the config, and which scheme each module has.

Both file forms, as vLLM's ``ModelOptQuantConfigBase.from_config`` reads them: the legacy
``hf_quant_config.json`` (``quantization.{quant_algo, group_size, exclude_modules,
quantized_layers, kv_cache_quant_algo}``) and ``config.json`` ``quantization_config``
(``quant_method: "modelopt"``, ``quant_algo``, ``ignore``, ``kv_cache_scheme``, ``quantized_layers``).
Per-module rules as vLLM's ``is_layer_excluded`` and ``ModelOptMixedPrecisionConfig``.
Facts: ../shared/docs/reference/hybrid-gdn-models.md sections 4.1 and 4.6.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from kvserve.quant.kv_cache_dtype import checkpoint_quant_method, read_quant_config

#: the ``quant_algo`` values kvserve accepts, and vLLM's method name for each
#: (``override_quantization_method`` of ModelOptFp8Config / ModelOptNvFp4Config / ModelOptMixedPrecisionConfig)
QUANT_ALGO_METHODS = {
    "FP8": "modelopt",
    "NVFP4": "modelopt_fp4",
    "W4A16_NVFP4": "modelopt_fp4",
    "MIXED_PRECISION": "modelopt_mixed",
}
QUANT_ALGOS = list(QUANT_ALGO_METHODS)
LAYER_ALGOS = ["FP8", "NVFP4", "W4A16_NVFP4"]  # what a MIXED_PRECISION layer can be
VLLM_ONLY_ALGOS = ["FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "MXFP8"]  # vLLM runs them, kvserve not yet
DEFAULT_GROUP_SIZE = 16
# the text model's prefix in HF checkpoints of image-text models, and kvserve's (= text-only HF)
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


@dataclass(frozen=True)
class LayerQuant:
    """One module's scheme: ``algo`` in ``LAYER_ALGOS``; ``group_size`` for the NVFP4 block scales."""

    algo: str
    group_size: int = DEFAULT_GROUP_SIZE


@dataclass(frozen=True)
class ModelOptConfig:
    """A ModelOpt checkpoint's quantization. ``quant_algo`` None: only the KV cache is quantized."""

    quant_algo: str | None
    method: str  # vLLM's --quantization name: modelopt | modelopt_fp4 | modelopt_mixed
    group_size: int
    exclude_modules: tuple[str, ...]
    quantized_layers: dict[str, LayerQuant] = field(default_factory=dict)  # MIXED_PRECISION: HF names
    kv_cache_quant_algo: str | None = None
    source: str = ""  # where it was read

    @property
    def quantizes_weights(self) -> bool:
        return self.quant_algo is not None

    def layer_quant(self, prefix: str, shards: tuple[str, ...] | list[str] | None = None) -> LayerQuant | None:
        """The scheme of module ``prefix`` (None: unquantized). A fused module (``qkv_proj``) names
        its checkpoint ``shards`` (``q_proj``, ``k_proj``, ``v_proj``): they must agree."""
        if self.quant_algo is None or self._excluded(prefix):
            return None
        if self.quant_algo != "MIXED_PRECISION" and any(s in prefix for s in ("visual", "vision")):
            return None  # older exports do not list the vision tower
        if not shards:
            return self._lookup(prefix) if self.quant_algo == "MIXED_PRECISION" else self._single()
        base = prefix.rsplit(".", 1)[0]
        if self.quant_algo == "MIXED_PRECISION":
            found = {s: self._lookup(f"{base}.{s}") for s in shards}
            if len(set(found.values())) > 1:
                sizes = {q.group_size for q in found.values() if q is not None}
                shown = {s: "unquantized" if q is None else q.algo if len(sizes) == 1
                         else f"{q.algo} (group_size {q.group_size})" for s, q in found.items()}
                raise ValueError(
                    f"Mixed quant_algo within fused layer {prefix}: {shown}. All shards must use the same quantization."
                )
            return found[shards[0]]
        skipped = {self._excluded(f"{base}.{s}") for s in shards}
        if len(skipped) > 1:
            raise ValueError(
                f"Detected some but not all shards of {prefix} are quantized. All shards of fused layers "
                f"to have the same precision. Shards {list(shards)}; exclude_modules {list(self.exclude_modules)}."
            )
        return None if skipped == {True} else self._single()

    def _single(self) -> LayerQuant:
        assert self.quant_algo is not None
        return LayerQuant(self.quant_algo, self.group_size)

    def _lookup(self, name: str) -> LayerQuant | None:
        """``quantized_layers`` entry of ``name`` (under any alias), else of a module below it
        (MoE experts: the entries name single experts)."""
        candidates = _aliases(name)
        for c in candidates:
            if c in self.quantized_layers:
                return self.quantized_layers[c]
        for c in candidates:
            for key, q in self.quantized_layers.items():
                if key.startswith(c + "."):
                    return q
        return None

    def _excluded(self, name: str) -> bool:
        """``exclude_modules`` / ``ignore``: exact name, substring (legacy lists), or a wildcard;
        ``x*`` means x and everything under it (vLLM's rewrite into ``x`` + ``x.*``)."""
        for c in _aliases(name):
            for pattern in self.exclude_modules:
                if c == pattern or pattern in c:
                    return True
                if pattern.endswith("*") and not pattern.endswith(".*"):
                    if fnmatch(c, pattern[:-1]) or fnmatch(c, pattern[:-1] + ".*"):
                        return True
                elif fnmatch(c, pattern):
                    return True
        return False


def _aliases(name: str) -> list[str]:
    """``name`` under the text model's other prefixes (``model.language_model.`` <-> ``model.`` <->
    ``language_model.model.``), and a bare ``lm_head``."""
    out = [name]
    for p in _PREFIXES:
        if name.startswith(p):
            out += [q + name[len(p):] for q in _PREFIXES]
            break
    if name.rsplit(".", 1)[-1] == "lm_head":
        out.append("lm_head")
    return list(dict.fromkeys(out))


def _algo_error(algo: str, where: str) -> ValueError:
    yet = " by kvserve yet (vLLM runs it)" if algo in VLLM_ONLY_ALGOS else ""
    return ValueError(f"ModelOpt quant_algo {algo!r} in {where} is not supported{yet}. kvserve supports: {QUANT_ALGOS}.")


def _layers(raw: Any, where: str) -> dict[str, LayerQuant]:
    if not isinstance(raw, dict):
        raise ValueError(f"quantized_layers in {where} must be a dict, got {type(raw)}")
    out = {}
    for name, info in raw.items():
        info = info if isinstance(info, dict) else {}
        algo = str(info.get("quant_algo") or "").upper()
        if algo not in LAYER_ALGOS:
            raise ValueError(
                f"quant_algo {algo or None!r} of layer {name!r} in {where} quantized_layers is not supported. "
                f"kvserve supports per layer: {LAYER_ALGOS}."
            )
        out[name] = LayerQuant(algo, int(info.get("group_size") or DEFAULT_GROUP_SIZE))
    return out


def read_modelopt_config(model_dir: str | Path, raw_config: dict[str, Any]) -> ModelOptConfig | None:
    """The checkpoint's ModelOpt config (None: not a ModelOpt checkpoint). Raises ValueError on a
    ``quant_algo`` kvserve does not run, naming it and where it was read."""
    qc, where = read_quant_config(model_dir, raw_config)
    if qc is None or not checkpoint_quant_method(qc).startswith("modelopt"):
        return None
    legacy = isinstance(qc.get("quantization"), dict)
    section = qc["quantization"] if legacy else qc
    if legacy:
        kv = section.get("kv_cache_quant_algo")
        exclude = section.get("exclude_modules", [])
    else:
        scheme = qc.get("kv_cache_scheme")
        if isinstance(scheme, dict):
            kv = "FP8" if scheme.get("type") == "float" and scheme.get("num_bits") == 8 else None
        else:
            kv = scheme or qc.get("kv_cache_quant_algo")
        exclude = qc.get("ignore", qc.get("exclude_modules", []))
    if kv is not None and not isinstance(kv, str):
        raise ValueError(f"kv_cache_quant_algo must be a string, got {type(kv)}")
    if not isinstance(exclude, list):
        raise ValueError(f"exclude_modules must be a list, got {type(exclude)}")
    raw_algo = section.get("quant_algo")
    algo = str(raw_algo).upper() if raw_algo else None
    method = checkpoint_quant_method(qc)  # KV cache only: the file's own name
    if algo is not None:
        if algo not in QUANT_ALGO_METHODS:
            raise _algo_error(algo, where)
        method = QUANT_ALGO_METHODS[algo]
    if legacy and algo in ("NVFP4", "W4A16_NVFP4"):
        missing = [k for k in ("group_size", "kv_cache_quant_algo", "exclude_modules") if k not in section]
        if missing:
            raise ValueError(f"NVFP4 quantization requires the following fields in hf_quant_config.json: {missing}")
    layers = _layers(section.get("quantized_layers") or {}, where) if algo == "MIXED_PRECISION" else {}
    if algo == "MIXED_PRECISION" and not layers:
        raise ValueError(
            "MIXED_PRECISION quant_algo requires a non-empty 'quantized_layers' mapping in the quantization config."
        )
    group_size = section.get("group_size")
    if group_size is None and layers:  # vLLM: the first NVFP4-family layer's
        group_size = next((q.group_size for q in layers.values() if q.algo != "FP8"), None)
    try:
        group_size = int(group_size if group_size is not None else DEFAULT_GROUP_SIZE)
    except (TypeError, ValueError):
        raise ValueError(f"group_size must be an integer, got {type(section.get('group_size'))}") from None
    return ModelOptConfig(
        quant_algo=algo,
        method=method,
        group_size=group_size,
        exclude_modules=tuple(str(m) for m in exclude),
        quantized_layers=layers,
        kv_cache_quant_algo=kv.upper() if kv else None,
        source=where,
    )
