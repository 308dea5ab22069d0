"""OpenAI-compatible HTTP server (``kvserve serve``), mirroring ``vllm serve``."""
