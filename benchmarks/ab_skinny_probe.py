"""Probe (2026-12-04, eighth session; kept in git history only): decode steps of the 27B MIXED export
with the GDN layers' b | a projection as the skinny Triton GEMM ("skinny", ``triton_layers.skinny_linear``)
and as the layer's cuBLAS GEMM ("cublas", patched in this process), the variants alternated; then,
with ``--profile``, where a c32 step goes with PDL off (``e2e_bench.profile_decode_step``).

    OUT=dir python3 benchmarks/ab_skinny_probe.py cublas,skinny,cublas,skinny 32 256 [--profile]
"""
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import e2e_bench  # noqa: E402
import hybrid_bench  # noqa: E402
from e2e_bench import tp  # noqa: E402

from kvserve.kernels import pdl  # noqa: E402
from kvserve.layers.gdn import GatedDeltaNet  # noqa: E402
from kvserve.tools.modelopt_export import export_config_only  # noqa: E402

skinny = GatedDeltaNet._ba
order, conc, osl = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
out = os.environ["OUT"]
runs = []
for i, name in enumerate(order):
    GatedDeltaNet._ba = skinny if name == "skinny" else (lambda self, x: self.in_proj_ba(x))
    f = f"{out}/ab_skinny_{i}_{name}.json"
    hybrid_bench.main(["--quantization", "MIXED_PRECISION", "--kv", "", "--concurrency", "", "--peer-concurrency", "",
                       "--decode-concurrency", conc, "--osl", osl, "--repeats", "1", "--out", f])
    d = json.load(open(f))
    dec = d["kvserve_quantized"]["kv"]["auto"]["decode"]
    runs.append({"variant": name, "result": d})
    print(f"AB {i} {name}: {json.dumps(dec)[:400]}", flush=True)
    os.remove(f)
json.dump({"probe": "benchmarks/ab_skinny_probe.py", "order": order, "concurrency": conc, "osl": osl,
           "runs": runs}, open(f"{out}/ab_skinny.json", "w"), indent=1)
GatedDeltaNet._ba = skinny
if "--profile" in sys.argv:
    pdl.enabled = False  # under PDL a kernel's profiled time includes its wait for the previous one
    folder = common.CONFIGS / "qwen3.6-27b"
    q = export_config_only(folder, Path(tempfile.mkdtemp()) / "q27", "MIXED_PRECISION")
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    n, isl = int(conc), 1024
    reqs = tp.random_requests(n, isl, 200, max_token_id=vocab - 1)
    kw = dict(model=str(q), dtype="bfloat16", load_format="dummy", kv_cache_dtype="auto", skip_tokenizer_init=True,
              max_model_len=isl + 216, max_num_seqs=n, device="cuda", enable_prefix_caching=False, seed=0)
    res = e2e_bench.profile_decode_step(kw, reqs, 20, 0.0)
    common.write_json(f"{out}/profile27b_nopdl.json", res)
    print("wrote profile27b_nopdl.json", flush=True)
