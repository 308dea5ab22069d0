"""Cost of the fp8 reads against the fp32 reference (golden set), on the CPU: the dequantizing read
(the reference path) and the quantized-query read (its torch twin, in the layers) with P shift 0
(TRITON_ATTN) and 8 (FLASH_ATTN). Usage: python fp8q_cost.py MODE {tf|greedy}"""
import dataclasses, sys
from kvserve.kernels import reference
import kvserve.layers.attention as A

mode, kind = sys.argv[1], sys.argv[2]
if mode != "dequant":
    shift = {"fp8q0": 0, "fp8q8": 8}[mode]
    orig = A.Attention.forward

    def forward(self, q, k, v, meta):
        if self.cache_quant is None:
            return orig(self, q, k, v, meta)
        quant = dataclasses.replace(self.cache_quant, query_fp8=True, q_scale=self.q_scale, p_shift=shift)
        reference.store_kv(k, v, self.kv_cache, meta.slot_mapping, self.cache_quant)
        tile = 128 if max(meta.query_lens) == 1 else 64  # the kernel's key tile for fp8 pages, head <= 128
        out = reference.paged_attention_fp8_query(q, self.kv_cache, meta.block_tables, meta.query_lens,
                                                  meta.seq_lens, self.scale, quant, tile)
        return out.flatten(1)

    A.Attention.forward = forward
from kvserve.entrypoints.cli import main
args = ["parity", "--prompts", "../shared/eval/golden_public.jsonl", "--reference",
        "../shared/eval/golden_public_vllm_fp32.jsonl", "--dtype", "float32", "--kv-cache-dtype", "fp8_e4m3"]
if kind == "tf":
    args.append("--teacher-forced")
sys.exit(main(args))
