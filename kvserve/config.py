"""Engine configuration: ``EngineArgs`` (the user's flags) -> typed configs the engine parts read."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvserve.attention_backend import AttentionBackend, resolve_attention_backend
from kvserve.choices import (
    DTYPE_CHOICES,
    KVSERVE_QUANTIZATION_METHODS,
    LOAD_FORMAT_CHOICES,
    MAMBA_CACHE_MODE_CHOICES,
    QUANTIZATION_CHOICES,
)
from kvserve.logger import init_logger
from kvserve.quant.kv_cache_dtype import (
    KV_CACHE_DTYPE_CHOICES,
    KVCacheDtype,
    KVQuantConfig,
    checkpoint_quant_method,
    read_kv_quant_config,
    read_quant_config,
    resolve_kv_cache_dtype,
)
from kvserve.quant.modelopt import ModelOptConfig, read_modelopt_config

logger = init_logger(__name__)

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}

GiB = 1 << 30
# vLLM's CPU default when VLLM_CPU_KVCACHE_SPACE is unset or 0 is a fixed number of GiB.
DEFAULT_CPU_KV_CACHE_SPACE_GIB = 4


@dataclass
class ModelConfig:
    """What the engine needs to know about the checkpoint."""

    model: str
    hf_config: Any  # transformers.PretrainedConfig
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    load_format: str = "auto"  # auto | safetensors | dummy (random weights, vLLM's DummyModelLoader)
    skip_tokenizer_init: bool = False  # no tokenizer: token-id prompts only, no output text
    quantization: str | None = None  # resolved --quantization (vLLM's name; None: unquantized)
    quant_config: ModelOptConfig | None = None  # the checkpoint's ModelOpt config, for the loader

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_size(self) -> int:
        return _head_size(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


@dataclass
class CacheConfig:
    """Paged KV cache: page geometry, dtype and memory budget."""

    block_size: int = 16
    cache_dtype: str = "auto"  # resolved name: float32 | bfloat16 | float16 | fp8 | fp8_e4m3 | fp8_e5m2
    kv_dtype: KVCacheDtype | None = None  # the resolved dtype with its origin and storage
    kv_quant: KVQuantConfig = KVQuantConfig()  # the checkpoint's KV quantization (scale method)
    kv_cache_memory: int | None = None  # bytes (CPU, or an explicit override on GPU)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    num_blocks: int = 0  # set by the memory planner
    # hybrid models: "align" = prefix caching with recurrent-state snapshots at step ends on
    # multiples of mamba_block_size tokens (None: derived by the runner); "none" = no snapshots
    mamba_cache_mode: str = "none"
    mamba_block_size: int | None = None


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # schedule step N+1 while step N runs on the device (vLLM's --async-scheduling); resolved
    async_scheduling: bool = False


@dataclass
class RunnerConfig:
    """How the model runs: the attention backend and CUDA graphs for decode batches."""

    attention_backend: str = "reference"  # the kernels: reference | triton
    # the --attention-backend choice (name and fp8 read)
    attention: AttentionBackend = field(default_factory=lambda: AttentionBackend("reference", "reference"))
    enforce_eager: bool = True  # no CUDA graphs (always off CUDA / reference backend; runner: uncapturable models)
    cudagraph_capture_sizes: list[int] = field(default_factory=list)  # ascending decode batch sizes


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: torch.device
    tokenizer: str | None
    runner_config: RunnerConfig = field(default_factory=RunnerConfig)


def _resolve_dtype(requested: str | torch.dtype, hf_config: Any, device: torch.device) -> torch.dtype:
    """``--dtype``: auto = the checkpoint's dtype; fp16 on CPU falls back to bf16 (vLLM's CPU rule)."""
    if isinstance(requested, torch.dtype):
        dtype = requested
    else:
        name = str(requested).lower()
        if name == "auto":
            ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
            if isinstance(ckpt, str):
                ckpt = getattr(torch, ckpt, None)
            dtype = ckpt if isinstance(ckpt, torch.dtype) and ckpt.is_floating_point else torch.float32
        elif name in _DTYPE_NAMES:
            dtype = _DTYPE_NAMES[name]
        else:
            raise ValueError(f"Unknown dtype: {requested!r}. Supported: {DTYPE_CHOICES}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype {dtype} is not supported. Supported: {DTYPE_CHOICES}")
    if device.type == "cpu" and dtype == torch.float16:
        logger.warning("float16 is not supported on CPU, casting to bfloat16.")
        dtype = torch.bfloat16
    return dtype


def _resolve_kv_cache_dtype(requested: str, model_dtype: torch.dtype, kv_quant: KVQuantConfig) -> KVCacheDtype:
    """``--kv-cache-dtype`` against the checkpoint; logs the outcome once, with vLLM's lines."""
    kv_dtype = resolve_kv_cache_dtype(requested, model_dtype, kv_quant)
    if kv_dtype.name == "fp8_e5m2" and kv_quant.method is not None:
        raise ValueError("fp8_e5m2 kv-cache is not supported with fp8 checkpoints.")
    declared = kv_quant.kv_cache_dtype
    # An explicit value overrides the checkpoint unless it names the same format (fp8 = fp8_e4m3).
    if requested != "auto" and declared is not None and kv_dtype.fp8_dtype != KVCacheDtype(declared, "").fp8_dtype:
        logger.warning(
            "--kv-cache-dtype %s overrides the checkpoint's KV cache quantization (%s from %s).",
            requested, kv_quant.kv_cache_dtype, kv_quant.source,
        )
    logger.info("kv_cache_dtype=%s (from %s)", kv_dtype.name, kv_dtype.origin)
    if kv_dtype.is_fp8:
        logger.info(
            "Using %s data type to store kv cache. It reduces the GPU memory footprint and boosts the "
            "performance. Meanwhile, it may cause accuracy drop without a proper scaling factor",
            kv_dtype.name,
        )
    return kv_dtype


def _resolve_quantization(
    requested: str | None, qc: dict[str, Any] | None, where: str, modelopt: ModelOptConfig | None
) -> str | None:
    """``--quantization`` against the checkpoint, as vLLM's ``ModelConfig._verify_quantization``:
    None takes the checkpoint's method; a ModelOpt checkpoint's ``quant_algo`` decides its method
    (vLLM's ``override_quantization_method``); any other disagreement is vLLM's error. Logs the
    outcome once."""
    if requested is not None:
        if requested not in QUANTIZATION_CHOICES:
            raise ValueError(f"Unknown quantization method: {requested}. Must be one of {QUANTIZATION_CHOICES}.")
        if requested not in KVSERVE_QUANTIZATION_METHODS:
            raise ValueError(
                f"Quantization method {requested} is not supported by kvserve. kvserve accepts: "
                f"{KVSERVE_QUANTIZATION_METHODS} (ModelOpt checkpoints)."
            )
    if qc is None:
        if requested is not None:  # vLLM's get_quant_config finds no hf_quant_config.json
            raise ValueError(f"Cannot find the config file for {requested}")
        logger.info("quantization=None (unquantized checkpoint)")
        return None
    if modelopt is not None:
        method: str | None = modelopt.method
        origin = f"the checkpoint ({modelopt.source} quant_algo={modelopt.quant_algo})"
    else:
        method = checkpoint_quant_method(qc) or None
        origin = f"the checkpoint ({where} quant_method={method})"
    if requested is not None and requested != method:
        if modelopt is None or not modelopt.quantizes_weights:
            raise ValueError(
                f"Quantization method specified in the model config ({method}) does not match the quantization "
                f"method specified in the `quantization` argument ({requested})."
            )
        logger.warning(
            "--quantization %s is overridden by the checkpoint: quant_algo %s runs as %s.",
            requested, modelopt.quant_algo, method,
        )
    logger.info("quantization=%s (from %s)", method, origin)
    return method


def resolve_async_scheduling(requested: bool | None, device: torch.device) -> bool:
    """vLLM's rule: ``None`` turns async scheduling on unless something rules it out. Here that
    is a CPU device, where torch runs every op before returning, so there is nothing to overlap
    (an explicit ``True`` is honoured everywhere: the tests run it on CPU)."""
    if requested is None:
        enabled = device.type == "cuda"
        logger.info("Asynchronous scheduling is %s.", "enabled" if enabled else f"disabled on {device.type}")
        return enabled
    return bool(requested)


def cudagraph_capture_sizes(max_num_seqs: int, max_capture_size: int | None = None) -> list[int]:
    """vLLM's default decode batch sizes for CUDA graphs: 1, 2, 4, multiples of 8 below 256, then
    multiples of 16, up to ``max_capture_size`` (default ``min(2 * max_num_seqs, 512)``), kept at
    or below max_num_seqs; max_num_seqs itself is added so every decode batch has a graph."""
    limit = min(2 * max_num_seqs, 512) if max_capture_size is None else max_capture_size
    if limit < 0:
        raise ValueError(f"max_cudagraph_capture_size must be non-negative, got {limit}.")
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, limit + 1, 16))
    sizes = [s for s in sizes if s <= min(limit, max_num_seqs)]
    if max_capture_size is None and max_num_seqs <= limit and max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(sizes)


def _resolve_mamba_cache_mode(
    mode: str, mamba_block_size: int | None, hybrid: bool, prefix_caching: bool, chunked_prefill: bool,
    architecture: str,
) -> str:
    """``--mamba-cache-mode`` as vLLM resolves it for Qwen3-Next / Qwen3.5 (which do not support
    "all"): prefix caching on -> "align" (with vLLM's warnings), off -> "none"."""
    if mode not in MAMBA_CACHE_MODE_CHOICES:
        raise ValueError(f"Unknown mamba_cache_mode: {mode!r}. Supported: {MAMBA_CACHE_MODE_CHOICES}")
    if mamba_block_size is not None and not prefix_caching:
        raise ValueError("--mamba-block-size can only be set with --enable-prefix-caching")
    if not hybrid:
        return mode
    if not prefix_caching:
        if mode != "none":
            logger.warning("Mamba cache mode is set to 'none' when prefix caching is disabled")
        return "none"
    if mode == "none":
        logger.warning(
            "Mamba cache mode is set to 'align' for %s by default when prefix caching is enabled", architecture
        )
    elif mode == "all":
        logger.warning(
            "Hybrid or mamba-based model detected without support for prefix caching with Mamba cache 'all' "
            "mode: falling back to 'align' mode."
        )
    if not chunked_prefill:
        raise ValueError(
            "Chunked prefill is required for mamba cache mode 'align'. Enable chunked prefill, or pass "
            "--no-enable-prefix-caching."
        )
    logger.info(
        "Warning: Prefix caching in Mamba cache 'align' mode is currently enabled. Its support for Mamba "
        "layers is experimental. Please report any issues you may observe."
    )
    return "align"


def is_hybrid_config(hf_config: Any) -> bool:
    """Whether the (text) config has Gated DeltaNet layers next to full attention (Qwen3-Next,
    Qwen3.5/3.6): their recurrent state lives in a slot pool, not in KV pages."""
    return getattr(hf_config, "linear_num_value_heads", None) is not None


def _head_size(c: Any) -> int:
    """The attention head size of a Hugging Face config: ``head_dim``, else hidden_size / heads."""
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _derive_max_model_len(hf_config: Any, requested: int | None) -> int:
    derived = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            derived = value if derived is None else min(derived, value)
    if derived is None:
        derived = 2048
    if requested is None:
        return derived
    if requested <= 0:
        raise ValueError(f"max_model_len must be positive, got {requested}.")
    if requested > derived:
        raise ValueError(
            f"User-specified max_model_len ({requested}) is greater than the derived max_model_len "
            f"(max_position_embeddings={derived} in model's config.json). Decrease max_model_len."
        )
    return requested


def _batch_defaults(device: torch.device) -> tuple[int, int]:
    """vLLM's LLM-class defaults (max_num_seqs, max_num_batched_tokens) for the device."""
    if device.type == "cpu":
        return 256, 4096
    total = torch.cuda.get_device_properties(device).total_memory
    name = torch.cuda.get_device_name(device).lower()
    if total >= 70 * GiB and "a100" not in name:
        return 1024, 16384
    return 256, 8192


def _cpu_kv_cache_bytes(explicit: int | None) -> int:
    if explicit is not None:
        if explicit <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {explicit}.")
        return int(explicit)
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or os.environ.get("KVSERVE_CPU_KVCACHE_SPACE")
    if env and float(env) > 0:
        return int(float(env) * GiB)
    logger.warning(
        "Environment variable VLLM_CPU_KVCACHE_SPACE (GiB) for CPU backend is not set, using %d by default.",
        DEFAULT_CPU_KV_CACHE_SPACE_GIB,
    )
    return DEFAULT_CPU_KV_CACHE_SPACE_GIB * GiB


@dataclass
class EngineArgs:
    """The flags of ``kvserve generate`` / ``LLM(...)``, named as in vLLM."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    seed: int = 0
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    max_cudagraph_capture_size: int | None = None
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    async_scheduling: bool | None = None
    mamba_cache_mode: str = "none"
    mamba_block_size: int | None = None

    def create_engine_config(self) -> EngineConfig:
        from transformers import AutoConfig

        from kvserve.models.registry import resolve_architecture

        model_path = self.model
        if model_path is None:
            from kvserve.loader.default_model import ensure_default_model

            model_path = str(ensure_default_model())
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model {model_path!r} is not a local Hugging Face checkpoint folder "
                "(no config.json found). Pass --model /path/to/folder with config.json and "
                "*.safetensors files."
            )
        with open(path / "config.json") as f:
            raw = json.load(f)
        architecture = resolve_architecture(raw.get("architectures") or [])
        hf_config = AutoConfig.from_pretrained(str(path))
        if getattr(hf_config, "text_config", None) is not None:
            # multimodal wrappers (Qwen3.5 *ForConditionalGeneration): kvserve serves the text model
            text_config = hf_config.get_text_config()
            if getattr(text_config, "dtype", None) is None:
                text_config.dtype = getattr(hf_config, "dtype", None)
            hf_config = text_config
        hybrid = is_hybrid_config(hf_config)

        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(self.device)
        dtype = _resolve_dtype(self.dtype, hf_config, device)
        if self.load_format not in LOAD_FORMAT_CHOICES:
            raise ValueError(f"Unknown load_format: {self.load_format!r}. Supported: {LOAD_FORMAT_CHOICES}")
        max_model_len = _derive_max_model_len(hf_config, self.max_model_len)

        qc, qc_where = read_quant_config(path, raw)
        quant_config = read_modelopt_config(path, raw)
        quantization = _resolve_quantization(self.quantization, qc, qc_where, quant_config)
        kv_quant = read_kv_quant_config(path, raw)
        kv_dtype = _resolve_kv_cache_dtype(self.kv_cache_dtype, dtype, kv_quant)
        attention = resolve_attention_backend(self.attention_backend, device, dtype, kv_dtype, _head_size(hf_config))
        backend = attention.kernels
        if self.block_size <= 0 or self.block_size % 8 or self.block_size > 256:
            raise ValueError(
                f"block_size must be a positive multiple of 8 up to 256, got {self.block_size}."
            )
        default_seqs, default_batched = _batch_defaults(device)
        max_num_seqs = self.max_num_seqs if self.max_num_seqs is not None else default_seqs
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                "gpu_memory_utilization must be in (0, 1], got "
                f"{self.gpu_memory_utilization}."
            )

        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = max(default_batched, max_num_seqs)
            if not self.enable_chunked_prefill:
                max_batched = max(max_batched, max_model_len)
        if max_batched < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be greater than or equal to "
                f"max_num_seqs ({max_num_seqs})."
            )
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) is smaller than max_model_len "
                f"({max_model_len}). This effectively limits the maximum sequence length to "
                "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
                "max_num_batched_tokens or decrease max_model_len."
            )

        enable_prefix_caching = self.enable_prefix_caching
        mamba_cache_mode = _resolve_mamba_cache_mode(
            self.mamba_cache_mode, self.mamba_block_size, hybrid, enable_prefix_caching,
            self.enable_chunked_prefill, architecture,
        )
        kv_bytes = _cpu_kv_cache_bytes(self.kv_cache_memory) if device.type == "cpu" else self.kv_cache_memory
        return EngineConfig(
            model_config=ModelConfig(
                model=str(path),
                hf_config=hf_config,
                architecture=architecture,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=self.seed,
                load_format=self.load_format,
                skip_tokenizer_init=self.skip_tokenizer_init,
                quantization=quantization,
                quant_config=quant_config,
            ),
            cache_config=CacheConfig(
                block_size=self.block_size,
                cache_dtype=kv_dtype.name,
                kv_dtype=kv_dtype,
                kv_quant=kv_quant,
                kv_cache_memory=kv_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                mamba_cache_mode=mamba_cache_mode,
                mamba_block_size=self.mamba_block_size,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                async_scheduling=resolve_async_scheduling(self.async_scheduling, device),
            ),
            device=device,
            tokenizer=None if self.skip_tokenizer_init else (self.tokenizer or str(path)),
            runner_config=RunnerConfig(
                attention_backend=backend,
                attention=attention,
                enforce_eager=self.enforce_eager or device.type != "cuda" or backend != "triton",
                cudagraph_capture_sizes=cudagraph_capture_sizes(max_num_seqs, self.max_cudagraph_capture_size),
            ),
        )
