"""Probe (2026-12-03, fifth session; kept in git history only): where the 27B MIXED export's c32 decode step
goes (e2e_bench.profile_decode_step on the current tree; OUT=dir, --smoke for a tiny CPU run; --no-pdl: PDL
off, so that each kernel's profiled time is its own and not its wait for the one before)."""
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "benchmarks")
import common  # noqa: E402
import e2e_bench  # noqa: E402
from e2e_bench import tp  # noqa: E402

from kvserve.tools.modelopt_export import export_config_only  # noqa: E402

smoke = "--smoke" in sys.argv
if "--no-pdl" in sys.argv:
    from kvserve.kernels import pdl

    pdl.enabled = False
folder = common.CONFIGS / "qwen3.6-27b"
if smoke:
    import hybrid_bench
    folder = hybrid_bench._tiny_config(Path(tempfile.mkdtemp()) / "tiny")
q = export_config_only(folder, Path(tempfile.mkdtemp()) / "q27", "MIXED_PRECISION")
vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
n, isl, osl = (2, 32, 40) if smoke else (32, 1024, 200)
reqs = tp.random_requests(n, isl, osl, max_token_id=vocab - 1)
kw = dict(model=str(q), dtype="float32" if smoke else "bfloat16", load_format="dummy", kv_cache_dtype="auto",
          skip_tokenizer_init=True, max_model_len=isl + osl + 16, max_num_seqs=n,
          device="cuda" if not smoke else "cpu", enable_prefix_caching=False, seed=0)
if smoke:
    kw["kv_cache_memory"] = 1 << 24
res = e2e_bench.profile_decode_step(kw, reqs, 3 if smoke else 20, 0.0)
common.write_json(os.environ.get("OUT", "/tmp") + "/profile27b.json", res)
print("wrote profile27b.json")
