"""Accepted values of the dtype flags. Torch-free, so ``kvserve --help`` and ``kvserve traffic``
parse their arguments without importing torch."""

DTYPE_CHOICES = ["auto", "half", "float16", "bfloat16", "float", "float32"]
KV_CACHE_DTYPE_CHOICES = ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
ATTENTION_BACKEND_CHOICES = ["auto", "reference", "triton", "FLASH_ATTN", "TRITON_ATTN"]  # (vLLM's names in capitals)
LOAD_FORMAT_CHOICES = ["auto", "safetensors", "dummy"]
MAMBA_CACHE_MODE_CHOICES = ["none", "all", "align"]
# vLLM's ``--quantization`` names (``QUANTIZATION_METHODS``, vllm/model_executor/layers/quantization/__init__.py)
QUANTIZATION_CHOICES = [
    "awq", "fp8", "ptpc_fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8",
    "modelopt_mixed", "gguf", "gptq_marlin", "awq_marlin", "gptq", "compressed-tensors", "bitsandbytes",
    "experts_int8", "quark", "moe_wna16", "torchao", "inc", "mxfp4", "petit_nvfp4", "cpu_awq",
]
# the ones kvserve runs (ModelOpt checkpoints)
KVSERVE_QUANTIZATION_METHODS = ["modelopt", "modelopt_fp4", "modelopt_mixed"]


def attention_backend_name(name: str) -> str:
    """An ``--attention-backend`` value as ``ATTENTION_BACKEND_CHOICES`` spells it: vLLM's names are
    parsed case-insensitively (as vLLM does), kvserve's too; anything else is returned unchanged."""
    text = str(name)
    for choice in ATTENTION_BACKEND_CHOICES:
        if text.lower() == choice.lower():
            return choice
    return text
