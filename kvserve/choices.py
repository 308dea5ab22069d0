"""Accepted values of the dtype flags. Torch-free, so ``kvserve --help`` and ``kvserve traffic``
parse their arguments without importing torch."""

DTYPE_CHOICES = ["auto", "half", "float16", "bfloat16", "float", "float32"]
KV_CACHE_DTYPE_CHOICES = ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
ATTENTION_BACKEND_CHOICES = ["auto", "reference", "triton"]
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
