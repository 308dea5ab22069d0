"""Accepted values of the dtype flags. Torch-free, so ``kvserve --help`` and ``kvserve traffic``
parse their arguments without importing torch."""

DTYPE_CHOICES = ["auto", "half", "float16", "bfloat16", "float", "float32"]
KV_CACHE_DTYPE_CHOICES = ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
ATTENTION_BACKEND_CHOICES = ["auto", "reference", "triton"]
LOAD_FORMAT_CHOICES = ["auto", "safetensors", "dummy"]
MAMBA_CACHE_MODE_CHOICES = ["none", "all", "align"]
